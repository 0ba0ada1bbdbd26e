// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
)

// told is a recorder that writes down what the device tells it.
type told []string

func (e *told) add(f string, args ...any) { *e = append(*e, fmt.Sprintf(f, args...)) }

func (e *told) begin(ctx uint64, need HistoryLevel) { e.add("begin %d %v", ctx, need) }
func (e *told) end()                                { e.add("end") }
func (e *told) allocated(b *pools.Block, s cuda.Stream) {
	e.add("allocated %d on %d", b.Requested, s)
	b.Context = 42
}
func (e *told) freeRequested(b *pools.Block) {
	e.add("free requested %d ctx %d", b.Requested, b.Context)
}
func (e *told) freeCompleted(b *pools.Block)    { e.add("free completed %d", b.Requested) }
func (e *told) restored(b *pools.Block)         { e.add("restored %d", b.Requested) }
func (e *told) segmentAllocated(*pools.Segment) { e.add("segment allocated") }
func (e *told) segmentFreed(*pools.Segment)     { e.add("segment freed") }
func (e *told) mapped(_ *pools.Segment, _, n uint64) {
	e.add("mapped %d", n)
}
func (e *told) unmapped(_ *pools.Segment, _, n uint64, lent bool) {
	e.add("unmapped %d lent %v", n, lent)
}
func (e *told) outOfMemory(r pools.Request, _ uint64) { e.add("oom %d", r.Size) }
func (e *told) snapshot(active uint64, _ PoolID)      { e.add("snapshot %d", active) }

// The device tells its recorder what happens, and nothing while it has
// none (history off): blocks then carry no context.
func TestDeviceTellsItsRecorder(t *testing.T) {
	ordinary, expandable := DefaultConfig(), DefaultConfig() // the default: expandable segments with stitching
	ordinary.ExpandableSegments, ordinary.Stitch = false, false
	expandable.Stitch = false
	for _, conf := range []Config{ordinary, expandable, DefaultConfig()} {
		a, err := New(sim.New(sim.Options{Memory: 1 << 30}), conf)
		require.NoError(t, err)
		d := a.devs[0]
		require.Nil(t, d.rec, "history off: no recorder")
		var ev told
		d.rec = &ev
		p, err := a.Malloc(&MallocRequest{Size: 4096, Stream: 1, Ctx: 7})
		require.NoError(t, err)
		require.NoError(t, a.Free(FreeRequest{Ptr: p, Size: 0, Ctx: 8}))
		_, err = a.Malloc(&MallocRequest{Size: 2 << 30, Stream: 1}) // the retry gives the segment back first
		require.Error(t, err)
		p, err = a.Malloc(&MallocRequest{Size: 4096, Stream: 1})
		require.NoError(t, err)
		require.NoError(t, a.Free(FreeRequest{Ptr: p}))
		require.NoError(t, a.EmptyCache(9))
		a.Snapshot(nil, false)
		seg, unseg := "segment allocated", "segment freed"
		if conf.ExpandableSegments {
			seg, unseg = "mapped 2097152", "unmapped 2097152 lent false" // a small pool: one page
		}
		// The 2 GiB miss: the retry gives the small pool's page back;
		// with stitching the miss first moves that idle page to the large
		// pool's range (mapped there before the rest fails), and the
		// retry unmaps it from there.
		retry := []string{unseg}
		if conf.Stitch {
			retry = []string{unseg, seg, unseg}
		}
		require.Equal(t, told(append(append([]string{
			"begin 7 state", seg, "allocated 4096 on 1", "end",
			"begin 8 all", "free requested 4096 ctx 42", "free completed 4096", "end",
			"begin 0 state"}, retry...), "oom 2147483648", "end",
			"begin 0 state", seg, "allocated 4096 on 1", "end",
			"begin 0 all", "free requested 4096 ctx 42", "free completed 4096", "end",
			"begin 9 all", unseg, "end",
			"snapshot 0")), ev, "expandable %v, stitch %v", conf.ExpandableSegments, conf.Stitch)

		// Without a recorder, no context sticks to a block.
		d.rec = nil
		p, err = a.Malloc(&MallocRequest{Size: 4096, Stream: 1, Ctx: 7})
		require.NoError(t, err)
		_, b := a.find(p)
		require.Zero(t, b.Context)
		d.leave()
		require.NoError(t, a.Free(FreeRequest{Ptr: p}))
	}
}
