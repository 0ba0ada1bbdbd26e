// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"encoding/json"
	"sync"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/stretchr/testify/require"
)

// Tests of the memory history (history.go). Context ids are arbitrary
// non-zero numbers standing for the stacks the C++ layer would gather.

func record(t testing.TB, a *allocator.Allocator, o allocator.HistoryOptions) {
	t.Helper()
	require.NoError(t, a.RecordHistory(o))
}

// traceOf takes a snapshot and returns device dev's trace (without the
// snapshot entries that earlier snapshots recorded).
func traceOf(a *allocator.Allocator, dev int) []allocator.TraceEntry {
	var out []allocator.TraceEntry
	for _, e := range a.Snapshot(nil, true).DeviceTraces[dev] {
		if e.Action != "snapshot" {
			out = append(out, e)
		}
	}
	return out
}

func actionsOf(tr []allocator.TraceEntry) []string {
	var out []string
	for _, e := range tr {
		out = append(out, e.Action)
	}
	return out
}

// entry returns the only entry of tr with the action.
func entry(t testing.TB, tr []allocator.TraceEntry, action string) allocator.TraceEntry {
	t.Helper()
	var found []allocator.TraceEntry
	for _, e := range tr {
		if e.Action == action {
			found = append(found, e)
		}
	}
	require.Len(t, found, 1, "entries %q in %v", action, actionsOf(tr))
	return found[0]
}

func blockAt(t testing.TB, snap allocator.Snapshot, p cuda.Ptr) (allocator.SegmentInfo, allocator.BlockInfo) {
	t.Helper()
	for _, s := range snap.Segments {
		for _, b := range s.Blocks {
			if b.Address == uint64(p) {
				return s, b
			}
		}
	}
	t.Fatalf("no block at %#x", p)
	return allocator.SegmentInfo{}, allocator.BlockInfo{}
}

// Which contexts are kept, and on what, at each level.
func TestHistoryLevels(t *testing.T) {
	const mallocCtx, freeCtx, emptyCtx = 11, 22, 33
	for _, tc := range []struct {
		level       allocator.HistoryLevel
		mask        uint32
		state       uint64   // block and segment contexts
		alloc       uint64   // on the alloc and segment_alloc entries
		freed       uint64   // on free_requested and free_completed
		segmentFree uint64   // on segment_free from empty_cache
		live        []uint64 // at the end, on entries only
	}{
		{allocator.HistoryNever, 0, 0, 0, 0, 0, nil},
		{allocator.HistoryState, allocator.GatherAlloc, mallocCtx, 0, 0, 0, nil},
		{allocator.HistoryAlloc, allocator.GatherAlloc, mallocCtx, mallocCtx, mallocCtx, mallocCtx, []uint64{mallocCtx}},
		{allocator.HistoryAll, allocator.GatherAlloc | allocator.GatherFree | allocator.GatherRelease, mallocCtx, mallocCtx, freeCtx, emptyCtx,
			[]uint64{mallocCtx, freeCtx, emptyCtx}},
	} {
		t.Run(tc.level.String(), func(t *testing.T) {
			a, _ := newAlloc(t, 1, GiB, ordinary)
			require.False(t, a.HistoryEnabled())
			require.Zero(t, a.GatherMask(), "nothing to gather while history is off")
			record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: tc.level})
			require.True(t, a.HistoryEnabled())
			require.Equal(t, tc.mask, a.GatherMask())

			p, err := a.Malloc(&allocator.MallocRequest{Size: 1000, Stream: 0, Ctx: mallocCtx})
			require.NoError(t, err)
			snap := a.Snapshot(nil, true)
			seg, blk := blockAt(t, snap, p)
			require.Equal(t, tc.state, blk.Context, "block context")
			require.Equal(t, tc.state, seg.Context, "segment context")
			require.True(t, blk.Allocated)
			require.True(t, blk.Active)
			tr := traceOf(a, 0)
			require.Equal(t, []string{"segment_alloc", "alloc"}, actionsOf(tr))
			require.Equal(t, tc.alloc, entry(t, tr, "alloc").Context)
			require.Equal(t, tc.alloc, entry(t, tr, "segment_alloc").Context)
			require.Equal(t, uint64(1000), entry(t, tr, "alloc").Size, "alloc entries record the requested size")
			require.Equal(t, uint64(2*MiB), entry(t, tr, "segment_alloc").Size)

			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 0, Ctx: freeCtx}))
			tr = traceOf(a, 0)
			require.Equal(t, tc.freed, entry(t, tr, "free_requested").Context)
			require.Equal(t, tc.freed, entry(t, tr, "free_completed").Context)
			require.Equal(t, uint64(1000), entry(t, tr, "free_completed").Size)
			_, blk = blockAt(t, a.Snapshot(nil, true), p)
			require.Zero(t, blk.Context, "a free block has no context")
			require.False(t, blk.Active)

			require.NoError(t, a.EmptyCache(emptyCtx))
			tr = traceOf(a, 0)
			require.Equal(t, tc.segmentFree, entry(t, tr, "segment_free").Context)
			require.Equal(t, tc.live, a.LiveContexts(nil))
			require.NoError(t, a.CheckInvariants())
		})
	}
}

// A free that waits for other streams completes in a later operation, whose
// context its free_completed entry carries (PyTorch: process_events and
// synchronize_and_free_events run with the caller's context).
func TestHistoryDeferredFreeCompleted(t *testing.T) {
	for _, level := range []allocator.HistoryLevel{allocator.HistoryAlloc, allocator.HistoryAll} {
		t.Run(level.String(), func(t *testing.T) {
			a, drv := newAlloc(t, 1, GiB, ordinary)
			record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: level})
			p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 5, Ctx: 1})
			require.NoError(t, err)
			require.NoError(t, a.RecordStream(p, 6))
			drv.Submit(6)
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 0, Ctx: 2}))
			tr := traceOf(a, 0)
			require.NotContains(t, actionsOf(tr), "free_completed")
			_, blk := blockAt(t, a.Snapshot(nil, true), p)
			require.Equal(t, "active_awaiting_free", blk.State)
			require.Equal(t, uint64(1), blk.Context, "the block keeps its context until the free completes")
			require.Contains(t, a.LiveContexts(nil), uint64(1))

			drv.CompleteAll()
			q, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 7, Ctx: 3}) // processes the events
			require.NoError(t, err)
			tr = traceOf(a, 0)
			require.Equal(t, uint64(3), entry(t, tr, "free_completed").Context, "the malloc that noticed")
			want := uint64(1)
			if level == allocator.HistoryAll {
				want = 2
			}
			require.Equal(t, want, entry(t, tr, "free_requested").Context)
			_, blk = blockAt(t, a.Snapshot(nil, true), p)
			require.Zero(t, blk.Context)

			// Completed by empty_cache: its context at level all, else the block's.
			require.NoError(t, a.RecordStream(q, 8))
			drv.Submit(8)
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q, Size: 0, Ctx: 4}))
			require.NoError(t, a.EmptyCache(9))
			var completed []uint64
			for _, e := range traceOf(a, 0) {
				if e.Action == "free_completed" {
					completed = append(completed, e.Context)
				}
			}
			want = 3
			if level == allocator.HistoryAll {
				want = 9
			}
			require.Equal(t, []uint64{3, want}, completed)
		})
	}
}

// Segments freed by a malloc's retry carry the malloc's context; an oom
// entry too, with the rounded size and the device's free memory.
func TestHistoryMallocRetryAndOOM(t *testing.T) {
	a, _ := newAlloc(t, 1, 100*MiB, ordinary)
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAlloc})
	p, err := a.Malloc(&allocator.MallocRequest{Size: 60 * MiB, Stream: 0, Ctx: 1})
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	q, err := a.Malloc(&allocator.MallocRequest{Size: 70 * MiB, Stream: 1, Ctx: 2}) // another stream: frees p's segment first
	require.NoError(t, err)
	tr := traceOf(a, 0)
	require.Equal(t, []string{"segment_alloc", "alloc", "free_requested", "free_completed", "segment_free", "segment_alloc", "alloc"}, actionsOf(tr))
	require.Equal(t, uint64(2), entry(t, tr, "segment_free").Context, "freed for the retrying malloc")

	_, err = a.Malloc(&allocator.MallocRequest{Size: 50*MiB + 100, Stream: 0, Ctx: 3})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	oom := entry(t, traceOf(a, 0), "oom")
	require.Equal(t, uint64(3), oom.Context)
	require.Equal(t, uint64(50*MiB+512), oom.Size, "the rounded size, as PyTorch")
	require.NotNil(t, oom.DeviceFree)
	require.Equal(t, uint64(30*MiB), *oom.DeviceFree)
	require.Equal(t, []uint64{1, 2, 3}, a.LiveContexts(nil), "q's block and segment (2), and the entries")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
}

func TestHistorySkipActionsAndBadOptions(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, ordinary)
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAll,
		SkipActions: []string{"alloc", "segment_alloc", "snapshot"}})
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 1})
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 0, Ctx: 2}))
	a.Snapshot(nil, true)
	require.Equal(t, []string{"free_requested", "free_completed"}, actionsOf(a.Snapshot(nil, true).DeviceTraces[0]),
		"skipped actions, snapshot entries included, are not recorded")

	for _, bad := range []allocator.HistoryOptions{
		{Enabled: true, MaxEntries: 10, SkipActions: []string{"alloc", "malloc"}},
		{Enabled: true, MaxEntries: 10, When: allocator.HistoryAll + 1},
		{Enabled: true, MaxEntries: 10, When: -1},
		{Enabled: true, MaxEntries: -1},
	} {
		err := a.RecordHistory(bad)
		require.ErrorIs(t, err, allocator.ErrInvalidArgument, "%+v", bad)
		var e *allocator.Error
		require.ErrorAs(t, err, &e)
		require.Equal(t, "record_history", e.Op)
	}
	err = a.RecordHistory(allocator.HistoryOptions{Enabled: true, SkipActions: []string{"malloc"}})
	require.Contains(t, err.Error(), `unknown action "malloc"`)
	require.Contains(t, err.Error(), "free_requested", "the message lists the known actions")

	// The failed calls changed nothing: level all, skips in force.
	require.Equal(t, allocator.GatherAlloc|allocator.GatherFree|allocator.GatherRelease, a.GatherMask())
	q, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 3})
	require.NoError(t, err)
	require.NotContains(t, actionsOf(a.Snapshot(nil, true).DeviceTraces[0]), "alloc")
	_, blk := blockAt(t, a.Snapshot(nil, true), q)
	require.Equal(t, uint64(3), blk.Context)
}

func TestHistoryClear(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	require.NoError(t, a.RecordAnnotation(0, [][2]string{{"name", "x"}}))
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAlloc})
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 1})
	require.NoError(t, err)
	require.NoError(t, a.RecordAnnotation(0, [][2]string{{"name", "x"}}))
	snap := a.Snapshot(nil, true)
	require.Len(t, snap.DeviceTraces[0], 2)
	require.Len(t, snap.ExternalAnnotations, 1, "the annotation made while off is not kept")

	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAlloc, Clear: true})
	snap = a.Snapshot(nil, true)
	require.Empty(t, snap.DeviceTraces[0])
	require.Empty(t, snap.ExternalAnnotations)
	_, blk := blockAt(t, snap, p)
	require.Equal(t, uint64(1), blk.Context, "clearing the trace keeps the blocks' contexts")
	require.Equal(t, []uint64{1}, a.LiveContexts(nil))

	// Without Clear, a new RecordHistory keeps what was recorded.
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAll})
	require.Equal(t, []string{"snapshot", "free_requested", "free_completed"}, actionsOf(a.Snapshot(nil, true).DeviceTraces[0]))
}

func TestHistoryDisableThenEnable(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAll})
	a.PushCompileContext("region")
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 5})
	require.NoError(t, err)

	record(t, a, allocator.HistoryOptions{Enabled: false, MaxEntries: 100, When: allocator.HistoryAll})
	require.False(t, a.HistoryEnabled())
	require.Zero(t, a.GatherMask())
	require.Empty(t, a.Snapshot(nil, true).DeviceTraces[0], "disabling clears the trace")
	q, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 6})
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q, Size: 0, Ctx: 7}))
	require.Empty(t, a.Snapshot(nil, true).DeviceTraces[0], "nothing is recorded while off")
	_, blk := blockAt(t, a.Snapshot(nil, true), p)
	require.Equal(t, uint64(5), blk.Context, "blocks keep the contexts they have")
	require.Equal(t, []uint64{5}, a.LiveContexts(nil), "context 6 came while off: not kept")
	a.PopCompileContext() // ignored while off, as in PyTorch

	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAlloc})
	require.True(t, a.HistoryEnabled())
	require.Equal(t, allocator.GatherAlloc, a.GatherMask())
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 0, Ctx: 8}))
	tr := traceOf(a, 0)
	require.Equal(t, []string{"free_requested", "free_completed"}, actionsOf(tr))
	require.Equal(t, uint64(5), tr[0].Context, "level alloc: the free's context is not kept, the block's is")
	require.Equal(t, "region", tr[0].CompileContext, "the pop while off was ignored")
	require.Equal(t, []uint64{5}, a.LiveContexts(nil), "now only on entries")
}

// The ring keeps the newest MaxEntries entries; overwritten entries release
// their contexts.
func TestHistoryRingOverwrite(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 4, When: allocator.HistoryAlloc,
		SkipActions: []string{"snapshot"}})
	for i := uint64(1); i <= 10; i++ {
		p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: i})
		require.NoError(t, err)
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	tr := a.Snapshot(nil, true).DeviceTraces[0]
	require.Len(t, tr, 4)
	require.Equal(t, []string{"free_completed", "alloc", "free_requested", "free_completed"}, actionsOf(tr))
	var ctxs []uint64
	for _, e := range tr {
		ctxs = append(ctxs, e.Context)
	}
	require.Equal(t, []uint64{9, 10, 10, 10}, ctxs, "the newest, oldest first")
	for i := 1; i < len(tr); i++ {
		require.GreaterOrEqual(t, tr[i].TimeUS, tr[i-1].TimeUS)
	}
	require.Equal(t, []uint64{1, 9, 10}, a.LiveContexts(nil), "the entries' and the segment's (1)")

	// A smaller ring keeps the newest entries; a larger one grows.
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 2, When: allocator.HistoryAlloc, SkipActions: []string{"snapshot"}})
	require.Equal(t, []string{"free_requested", "free_completed"}, actionsOf(a.Snapshot(nil, true).DeviceTraces[0]))
	require.Equal(t, []uint64{1, 10}, a.LiveContexts(nil))
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 1000, When: allocator.HistoryAlloc, SkipActions: []string{"snapshot"}})
	for i := uint64(11); i <= 300; i++ {
		p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: i})
		require.NoError(t, err)
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.Len(t, a.Snapshot(nil, true).DeviceTraces[0], 2+3*290)

	// A ring of zero entries keeps no trace, but the state level still holds.
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 0, When: allocator.HistoryState})
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 400})
	require.NoError(t, err)
	require.Empty(t, a.Snapshot(nil, true).DeviceTraces[0])
	require.Equal(t, []uint64{1, 400}, a.LiveContexts(nil))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
}

func TestHistoryUserMetadataAndCompileContext(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	a.PushCompileContext("ignored") // history off
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAlloc, SkipActions: []string{"snapshot"}})
	a.SetUserMetadata("step 1")
	require.Equal(t, "step 1", a.UserMetadata())
	p := mustMalloc(t, a, 0, 4096, 0)
	a.PushCompileContext("Torch-Compiled Region: 0/0")
	a.PushCompileContext("Torch-Compiled Region: 1/0")
	q := mustMalloc(t, a, 0, 4096, 0)
	a.PopCompileContext()
	a.SetUserMetadata("step 2")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	a.PopCompileContext()
	a.PopCompileContext() // more pops than pushes: ignored
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))

	type labels struct{ compile, user string }
	var got []labels
	for _, e := range a.Snapshot(nil, true).DeviceTraces[0] {
		got = append(got, labels{e.CompileContext, e.UserMetadata})
	}
	require.Equal(t, []labels{
		{"N/A", "step 1"}, {"N/A", "step 1"}, // p's segment and alloc
		{"Torch-Compiled Region: 1/0", "step 1"},
		{"Torch-Compiled Region: 0/0", "step 2"}, {"Torch-Compiled Region: 0/0", "step 2"},
		{"N/A", "step 2"}, {"N/A", "step 2"},
	}, got)
}

func TestHistoryAnnotations(t *testing.T) {
	a, _ := newAlloc(t, 2, GiB, "")
	require.NoError(t, a.RecordAnnotation(0, [][2]string{{"name", "off"}}), "ignored while off")
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 3, When: allocator.HistoryState})
	require.ErrorIs(t, a.RecordAnnotation(2, nil), allocator.ErrInvalidDevice)
	require.NoError(t, a.RecordAnnotation(1, [][2]string{{"name", "fwd"}, {"stage", "START"}}))
	require.NoError(t, a.RecordAnnotation(0, [][2]string{{"name", "fwd"}, {"stage", "x"}, {"stage", "END"}}))
	snap := a.Snapshot(nil, true)
	require.Len(t, snap.ExternalAnnotations, 2)
	require.Equal(t, 1, snap.ExternalAnnotations[0].Device)
	require.Equal(t, [][2]string{{"name", "fwd"}, {"stage", "END"}}, snap.ExternalAnnotations[1].Metadata, "a later key overrides")
	require.NotZero(t, snap.ExternalAnnotations[0].TimeUS)

	js, err := json.Marshal(snap.ExternalAnnotations[0])
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(js, &m))
	require.Equal(t, map[string]any{"name": "fwd", "stage": "START", "device": 1.0, "time_us": float64(snap.ExternalAnnotations[0].TimeUS)}, m)
	js, err = json.Marshal(allocator.AnnotationEntry{Device: 3, TimeUS: 4, Metadata: [][2]string{{"device", "mine"}, {"q\"", "\n"}}})
	require.NoError(t, err)
	require.JSONEq(t, `{"device":"mine","q\"":"\n","time_us":4}`, string(js))

	for i := 0; i < 5; i++ {
		require.NoError(t, a.RecordAnnotation(0, [][2]string{{"i", string(rune('a' + i))}}))
	}
	snap = a.Snapshot(nil, true)
	require.Len(t, snap.ExternalAnnotations, 3, "the last MaxEntries")
	require.Equal(t, "c", snap.ExternalAnnotations[0].Metadata[0][1])
	require.Empty(t, a.Snapshot(nil, false).ExternalAnnotations, "only with traces, as PyTorch")
	record(t, a, allocator.HistoryOptions{})
	require.Empty(t, a.Snapshot(nil, true).ExternalAnnotations, "disabling clears them")
}

func TestHistoryLiveContexts(t *testing.T) {
	a, drv := newAlloc(t, 2, GiB, ordinary)
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryState})
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 30})
	require.NoError(t, err)
	q, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 20}) // same segment as p, whose context is 30
	require.NoError(t, err)
	r, err := a.Malloc(&allocator.MallocRequest{Dev: 1, Size: 4096, Stream: 0, Ctx: 20})
	require.NoError(t, err)
	require.NoError(t, a.RecordStream(r, 3))
	drv.Submit(3)
	require.NoError(t, a.Free(allocator.FreeRequest{Dev: 1, Ptr: r, Size: 0, Ctx: 99})) // awaits stream 3; 99 ignored below level all
	dst := a.LiveContexts([]uint64{7})
	require.Equal(t, []uint64{7, 20, 30}, dst, "appended after dst's contents, sorted, without duplicates")

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q}))
	require.Equal(t, []uint64{20, 30}, a.LiveContexts(nil), "r still awaits its free")
	drv.CompleteAll()
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, []uint64{30}, a.LiveContexts(nil), "device 1's segment and block are gone")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.Equal(t, []uint64{30}, a.LiveContexts(nil), "the segment keeps the context that allocated it")
	require.NoError(t, a.EmptyCache(0))
	require.Empty(t, a.LiveContexts(nil))

	// On entries, from level alloc; gone when overwritten or cleared.
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 2, When: allocator.HistoryAlloc, SkipActions: []string{"snapshot", "segment_alloc"}})
	p, err = a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 40})
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.Equal(t, []uint64{40}, a.LiveContexts(nil), "segment and the two entries")
	require.NoError(t, a.EmptyCache(0)) // segment_free with the segment's context
	p, err = a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 50})
	require.NoError(t, err)
	require.Equal(t, []uint64{40, 50}, a.LiveContexts(nil), "40 on the segment_free entry")
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.Equal(t, []uint64{50}, a.LiveContexts(nil), "40's entries were overwritten, its segment freed")
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 2, When: allocator.HistoryAlloc, Clear: true})
	require.Equal(t, []uint64{50}, a.LiveContexts(nil), "the segment's")
	require.NoError(t, a.EmptyCache(0))
	require.Equal(t, []uint64{50}, a.LiveContexts(nil), "the segment_free entry's")
	record(t, a, allocator.HistoryOptions{Enabled: false})
	require.Empty(t, a.LiveContexts(nil))
}

// A pool's snapshot has its segments only; entries name the pool.
func TestHistoryPoolSnapshotAndCapture(t *testing.T) {
	lockThread(t)
	a, drv := newAlloc(t, 1, GiB, ordinary)
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAll})
	const cs = cuda.Stream(7)
	eager, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: cs, Ctx: 1})
	require.NoError(t, err)
	require.NoError(t, a.RecordStream(eager, 2))
	drv.Submit(2)

	g := allocator.PoolID{A: 1}
	beginCapture(t, a, drv, g, cs, cuda.CaptureModeGlobal)
	x, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: cs, Ctx: 2})
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: eager, Size: 0, Ctx: 3})) // deferred: no event during a capture
	y, err := a.Malloc(&allocator.MallocRequest{Size: 3 * MiB, Stream: cs, Ctx: 4})
	require.NoError(t, err)
	require.NoError(t, drv.EndCapture(cs))
	require.NoError(t, a.EndAllocateToPool(0, g))
	require.Zero(t, drv.Violations(), "recording history makes no driver call: %v", drv.ViolationLog())

	tr := traceOf(a, 0)
	pools := map[string][][2]uint64{}
	for _, e := range tr {
		pools[e.Action] = append(pools[e.Action], e.PoolID)
		require.Equal(t, 0, e.Device)
	}
	require.Equal(t, [][2]uint64{{0, 0}, {1, 0}, {1, 0}}, pools["alloc"])
	require.Equal(t, [][2]uint64{{0, 0}, {1, 0}, {1, 0}}, pools["segment_alloc"])
	require.Equal(t, [][2]uint64{{0, 0}}, pools["free_requested"])
	require.NotContains(t, pools, "free_completed", "deferred until the capture ended")

	only := a.Snapshot(&g, false)
	require.Len(t, only.Segments, 2)
	for _, s := range only.Segments {
		require.Equal(t, [2]uint64{1, 0}, s.SegmentPoolID)
	}
	_, blk := blockAt(t, only, y)
	require.Equal(t, uint64(4), blk.Context)
	require.Empty(t, only.DeviceTraces, "no traces asked for")
	def := a.Snapshot(&allocator.PoolID{}, false)
	require.Len(t, def.Segments, 1)
	require.Equal(t, uint64(eager), def.Segments[0].Address)
	require.Empty(t, a.Snapshot(&allocator.PoolID{A: 42}, false).Segments, "an unknown pool has no segments")
	var snaps [][2]uint64
	for _, e := range a.Snapshot(nil, true).DeviceTraces[0] {
		if e.Action == "snapshot" {
			snaps = append(snaps, e.PoolID)
		}
	}
	require.Equal(t, [][2]uint64{{0, 0}, {1, 0}, {0, 0}, {42, 0}}, snaps, "each snapshot is recorded with the pool asked for")

	drv.CompleteAll()
	z, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: cs, Ctx: 5}) // the deferred free completes here
	require.NoError(t, err)
	fc := entry(t, traceOf(a, 0), "free_completed")
	require.Equal(t, uint64(eager), fc.Addr)
	require.Equal(t, uint64(5), fc.Context, "the malloc that completed it")
	require.Equal(t, [2]uint64{0, 0}, fc.PoolID)
	for _, p := range []cuda.Ptr{x, y, z} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.NoError(t, a.ReleasePool(0, g))
	require.NoError(t, a.EmptyCache(6))
	var freed [][2]uint64
	for _, e := range traceOf(a, 0) {
		if e.Action == "segment_free" {
			freed = append(freed, e.PoolID)
			require.Equal(t, uint64(6), e.Context)
		}
	}
	require.ElementsMatch(t, [][2]uint64{{0, 0}, {1, 0}, {1, 0}}, freed)
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// Expandable segments: segment_map and segment_unmap carry contexts; the
// segment's context is the one that mapped its start.
func TestHistoryExpandable(t *testing.T) {
	lockThread(t)
	a, _ := newAlloc(t, 1, GiB, expandable)
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAlloc})
	p, err := a.Malloc(&allocator.MallocRequest{Size: 3 * MiB, Stream: 0, Ctx: 1})
	require.NoError(t, err)
	q, err := a.Malloc(&allocator.MallocRequest{Size: 5 * MiB, Stream: 0, Ctx: 2})
	require.NoError(t, err)
	r, err := a.Malloc(&allocator.MallocRequest{Size: 3 * MiB, Stream: 0, Ctx: 3})
	require.NoError(t, err)
	var maps []uint64
	for _, e := range traceOf(a, 0) {
		if e.Action == "segment_map" {
			maps = append(maps, e.Context)
		}
	}
	require.Equal(t, []uint64{1, 2, 3}, maps)
	require.NotContains(t, actionsOf(traceOf(a, 0)), "segment_alloc", "expandable segments map, as in PyTorch")

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: q, Size: 0, Ctx: 4}))
	require.NoError(t, a.EmptyCache(5)) // level alloc: empty_cache's context not kept
	unmap := entry(t, traceOf(a, 0), "segment_unmap")
	require.Zero(t, unmap.Context, "not the segment's start: no context")
	snap := a.Snapshot(nil, true)
	require.Len(t, snap.Segments, 2)
	require.Equal(t, uint64(1), snap.Segments[0].Context, "the run at the segment's start")
	require.Zero(t, snap.Segments[1].Context)

	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAll, Clear: true})
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: r}))
	require.NoError(t, a.EmptyCache(6))
	for _, e := range traceOf(a, 0) {
		if e.Action == "segment_unmap" {
			require.Equal(t, uint64(6), e.Context, "level all: empty_cache's context")
		}
	}
	require.Empty(t, a.Snapshot(nil, true).Segments, "all unmapped: the segment is gone")
	require.NoError(t, a.CheckInvariants())

	// At level alloc, unmapping the segment's start falls back to its context.
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAlloc, Clear: true})
	p, err = a.Malloc(&allocator.MallocRequest{Size: 3 * MiB, Stream: 0, Ctx: 7})
	require.NoError(t, err)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, a.EmptyCache(8))
	require.Equal(t, uint64(7), entry(t, traceOf(a, 0), "segment_unmap").Context)

	// Mapping later pages does not give a segment a context it lacks.
	b, _ := newAlloc(t, 1, GiB, expandable)
	mustMalloc(t, b, 0, 3*MiB, 0)
	record(t, b, allocator.HistoryOptions{Enabled: true, When: allocator.HistoryState})
	q, err = b.Malloc(&allocator.MallocRequest{Size: 5 * MiB, Stream: 0, Ctx: 9})
	require.NoError(t, err)
	snap = b.Snapshot(nil, true)
	require.Len(t, snap.Segments, 1)
	require.Zero(t, snap.Segments[0].Context)
	_, blk := blockAt(t, snap, q)
	require.Equal(t, uint64(9), blk.Context)
}

// The old configuration key records the trace without contexts.
func TestHistoryConfigKey(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, ordinary+",record_history:8")
	require.True(t, a.HistoryEnabled())
	require.Zero(t, a.GatherMask(), "record_history:N gathers no stacks")
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 1})
	require.NoError(t, err)
	tr := traceOf(a, 0)
	require.Equal(t, []string{"segment_alloc", "alloc"}, actionsOf(tr))
	require.Zero(t, tr[1].Context)
	require.Empty(t, a.LiveContexts(nil))
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))

	// Other keys leave a history set by RecordHistory alone.
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAll})
	cfg, _, err := allocator.ParseConfig("record_history:8,max_split_size_mb:100")
	require.NoError(t, err)
	a.Configure(cfg)
	require.Equal(t, allocator.GatherAlloc|allocator.GatherFree|allocator.GatherRelease, a.GatherMask())
	cfg, _, err = allocator.ParseConfig("max_split_size_mb:100")
	require.NoError(t, err)
	a.Configure(cfg)
	require.False(t, a.HistoryEnabled(), "record_history changed to 0: off")
	require.Empty(t, a.Snapshot(nil, true).DeviceTraces[0])
}

func TestHistorySnapshotJSON(t *testing.T) {
	a, _ := newAlloc(t, 1, 100*MiB, "")
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAll})
	a.SetUserMetadata("meta")
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 3, Ctx: 12})
	require.NoError(t, err)
	_, err = a.Malloc(&allocator.MallocRequest{Size: 200 * MiB, Stream: 3, Ctx: 13})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	require.NoError(t, a.RecordAnnotation(0, [][2]string{{"name", "n"}}))
	js, err := json.Marshal(a.Snapshot(nil, true))
	require.NoError(t, err)
	var m struct {
		Segments []struct {
			Context uint64 `json:"context"`
			Frames  []any  `json:"frames"`
			Blocks  []struct {
				Context   uint64 `json:"context"`
				Allocated bool   `json:"allocated"`
				Frames    []any  `json:"frames"`
			} `json:"blocks"`
		} `json:"segments"`
		DeviceTraces [][]map[string]any `json:"device_traces"`
		Annotations  []map[string]any   `json:"external_annotations"`
		Settings     map[string]any     `json:"allocator_settings"`
	}
	require.NoError(t, json.Unmarshal(js, &m))
	require.Len(t, m.Segments, 1)
	require.Equal(t, uint64(12), m.Segments[0].Context)
	require.NotNil(t, m.Segments[0].Frames, "frames stays []")
	require.Equal(t, uint64(12), m.Segments[0].Blocks[0].Context)
	require.True(t, m.Segments[0].Blocks[0].Allocated)
	tr := m.DeviceTraces[0]
	require.Len(t, tr, 3)
	require.Equal(t, map[string]any{"action": "alloc", "addr": float64(p), "size": 4096.0, "stream": 3.0,
		"time_us": tr[1]["time_us"], "device": 0.0, "pool_id": []any{0.0, 0.0}, "context": 12.0,
		"compile_context": "N/A", "user_metadata": "meta", "frames": []any{}}, tr[1])
	require.Equal(t, "oom", tr[2]["action"])
	require.Equal(t, 13.0, tr[2]["context"])
	require.Contains(t, tr[2], "device_free")
	require.Equal(t, "n", m.Annotations[0]["name"])
	require.Contains(t, m.Annotations[0], "time_us")
	require.NotNil(t, m.Settings)
}

// The context-carrying malloc and free allocate no Go memory on a cache hit,
// with history off and on (once the ring is full).
func TestHistoryAllocsPerRun(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "")
	a.ExpectAnnouncements()
	run := func() {
		p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 1})
		_ = a.Free(allocator.FreeRequest{Ptr: p, Size: 0, Ctx: 2})
	}
	run()
	require.Zero(t, testing.AllocsPerRun(1000, run), "history off")

	for _, level := range []allocator.HistoryLevel{allocator.HistoryNever, allocator.HistoryState, allocator.HistoryAlloc, allocator.HistoryAll} {
		record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 64, When: level})
		a.SetUserMetadata("m")
		a.PushCompileContext("c")
		for i := 0; i < 64; i++ {
			run() // fills the ring
		}
		require.Zero(t, testing.AllocsPerRun(1000, run), "history on, level %v", level)
		batch := make([]allocator.FreeRequest, 1)
		p := mustMalloc(t, a, 0, 4096, 0)
		require.Zero(t, testing.AllocsPerRun(1000, func() {
			batch[0] = allocator.FreeRequest{Ptr: p, Size: 4096, Ctx: 3}
			p, _, _ = mallocAfterFrees(a, 0, 4096, 0, 4, batch)
		}), "a malloc request with frees and contexts, level %v", level)
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
		a.PopCompileContext()
		require.Len(t, a.Snapshot(nil, true).DeviceTraces[0], 64)
	}
}

// A malloc request passes each free's context and the malloc's.
func TestHistoryMallocRequestFrees(t *testing.T) {
	a, _ := newAlloc(t, 2, GiB, "")
	record(t, a, allocator.HistoryOptions{Enabled: true, MaxEntries: 100, When: allocator.HistoryAll})
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096, Stream: 0, Ctx: 1})
	require.NoError(t, err)
	q, err := a.Malloc(&allocator.MallocRequest{Dev: 1, Size: 4096, Stream: 0, Ctx: 2})
	require.NoError(t, err)
	r, err, ferr := mallocAfterFrees(a, 0, 4096, 0, 5, []allocator.FreeRequest{{Ptr: p, Ctx: 3}, {Dev: 1, Ptr: q, Ctx: 4}})
	require.NoError(t, err)
	require.NoError(t, ferr)
	require.Equal(t, p, r)
	tr := traceOf(a, 0)
	require.Equal(t, uint64(3), entry(t, tr, "free_requested").Context)
	require.Equal(t, uint64(3), entry(t, tr, "free_completed").Context)
	require.Equal(t, []uint64{1, 5}, []uint64{tr[1].Context, tr[4].Context}, "the allocs")
	require.Equal(t, uint64(4), entry(t, traceOf(a, 1), "free_requested").Context)
	_, blk := blockAt(t, a.Snapshot(nil, true), r)
	require.Equal(t, uint64(5), blk.Context)
	// The early path (size 0) passes them too.
	_, err, ferr = mallocAfterFrees(a, 0, 0, 0, 6, []allocator.FreeRequest{{Ptr: r, Ctx: 7}})
	require.NoError(t, err)
	require.NoError(t, ferr)
	var last allocator.TraceEntry
	for _, e := range traceOf(a, 0) {
		if e.Action == "free_requested" {
			last = e
		}
	}
	require.Equal(t, uint64(7), last.Context)
}

// History changes race with allocations, frees and snapshots (run with -race).
func TestHistoryConcurrent(t *testing.T) {
	a, _ := newAlloc(t, 2, GiB, "")
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			var live []cuda.Ptr
			for i := 0; ; i++ {
				select {
				case <-stop:
					for _, p := range live {
						_ = a.Free(allocator.FreeRequest{Dev: g % 2, Ptr: p})
					}
					return
				default:
				}
				mask := a.GatherMask()
				var ctx uint64
				if mask&allocator.GatherAlloc != 0 {
					ctx = uint64(i + 1)
				}
				p, err := a.Malloc(&allocator.MallocRequest{Dev: g % 2, Size: uint64(512 + i%5000), Stream: cuda.Stream(g), Ctx: ctx})
				if err != nil {
					t.Error(err)
					return
				}
				live = append(live, p)
				if len(live) > 8 {
					if err := a.Free(allocator.FreeRequest{Dev: g % 2, Ptr: live[0], Size: 0, Ctx: ctx}); err != nil {
						t.Error(err)
						return
					}
					live = live[1:]
				}
			}
		}(g)
	}
	for i := 0; i < 200; i++ {
		lvl := allocator.HistoryLevel(i % 4)
		require.NoError(t, a.RecordHistory(allocator.HistoryOptions{Enabled: i%5 != 4, MaxEntries: 1 + i%50, When: lvl, Clear: i%7 == 0}))
		a.SetUserMetadata("m")
		a.PushCompileContext("c")
		_ = a.RecordAnnotation(i%2, [][2]string{{"i", "x"}})
		a.Snapshot(nil, true)
		a.LiveContexts(nil)
		a.PopCompileContext()
		if i%50 == 0 {
			require.NoError(t, a.EmptyCache(uint64(i+1)))
		}
	}
	close(stop)
	wg.Wait()
	require.NoError(t, a.CheckInvariants())
}
