// SPDX-License-Identifier: Apache-2.0

package graphs_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/events"
	"github.com/cudapool/cudapool/graphs"
	"github.com/cudapool/cudapool/pools"
)

// fork makes stream to wait for stream from's work so far.
func fork(t *testing.T, drv *sim.Driver, from, to cuda.Stream) {
	t.Helper()
	ev, err := drv.EventCreate(0)
	require.NoError(t, err)
	require.NoError(t, drv.EventRecord(0, ev, from))
	require.NoError(t, drv.StreamWaitEvent(0, to, ev))
	require.NoError(t, drv.EventDestroy(0, ev))
}

// A block of stream 1 read on stream 2 (forked from 1) and freed during
// the capture comes back once 2 joins 1, not before; without the option,
// or without the driver's queries, it waits.
func TestReuseReclaimsAfterJoin(t *testing.T) {
	drv := sim.New(sim.Options{})
	require.NoError(t, drv.BeginCapture(1, cuda.CaptureModeThreadLocal))
	fork(t, drv, 1, 2)
	drv.Submit(2) // the read
	tr := events.New(drv, 0)
	b := &pools.Block{Stream: 1, Ptr: 0x1000}
	events.RecordUse(b, 2)
	tr.Defer(b)

	var r graphs.Reuse
	require.NoError(t, r.NoteFree(drv, 0, b))
	require.True(t, r.Empty(), "the option is off")
	r.On = true
	require.NoError(t, r.NoteFree(nil, 0, b))
	require.True(t, r.Empty(), "no topology queries: nothing noted")
	require.NoError(t, r.NoteFree(drv, 0, b))
	markers, _ := r.State()
	require.Equal(t, 1, markers)

	var back []*pools.Block
	ret := func(x *pools.Block) { back = append(back, x) }
	drv.Submit(1)
	require.NoError(t, r.Reclaim(drv, 0, 1, tr, ret))
	require.Empty(t, back, "stream 1 has not joined stream 2")
	_, walks := r.State()
	require.Equal(t, 1, walks)

	fork(t, drv, 2, 1)
	require.NoError(t, r.Reclaim(drv, 0, 2, tr, ret))
	require.Empty(t, back, "only mallocs of the block's own stream reclaim it")
	require.NoError(t, r.Reclaim(drv, 0, 1, tr, ret))
	require.Equal(t, []*pools.Block{b}, back)
	require.True(t, b.Uses.Empty(), "the graph ordered its uses")
	_, def := tr.Pending()
	require.Zero(t, def, "taken out of the deferred frees")
	require.True(t, r.Empty(), "nothing left to prove: the walk is forgotten")
	require.NoError(t, drv.EndCapture(1))
}

// A failed query is returned with its stream; Drop forgets everything.
func TestReuseQueryErrors(t *testing.T) {
	drv := sim.New(sim.Options{})
	b := &pools.Block{Stream: 3, Ptr: 0x1000}
	events.RecordUse(b, 4)
	r := graphs.Reuse{On: true}
	err := r.NoteFree(drv, 0, b) // stream 3 is not capturing: no markers
	require.NoError(t, err)
	require.True(t, r.Empty())
	err = r.NoteFree(drv, 7, b) // no such device
	var qe *graphs.QueryError
	require.ErrorAs(t, err, &qe)
	require.Equal(t, cuda.Stream(3), qe.Stream)
	require.Contains(t, err.Error(), "reading the capture graph of stream 0x3")

	require.NoError(t, drv.BeginCapture(3, cuda.CaptureModeThreadLocal))
	fork(t, drv, 3, 4)
	drv.Submit(4)
	require.NoError(t, r.NoteFree(drv, 0, b))
	require.False(t, r.Empty())
	r.Drop()
	require.True(t, r.Empty())
	fork(t, drv, 4, 3)
	require.NoError(t, drv.EndCapture(3))
}
