// SPDX-License-Identifier: Apache-2.0

package graphs_test

import (
	"testing"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/graphs"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/privatepool"
	"github.com/stretchr/testify/require"
)

func mk(id pools.PoolID) (*pools.BlockPool, *pools.BlockPool) {
	c := pools.NewCache(pools.DefaultConfig())
	return c.NewPool(true, id), c.NewPool(false, id)
}

func TestNewestCaptureFirst(t *testing.T) {
	var r graphs.Router
	g1, g2 := pools.PoolID{A: 1}, pools.PoolID{A: 2}
	require.NoError(t, r.Begin(g1, func(s cuda.Stream) bool { return s <= 2 }, mk))
	require.NoError(t, r.Begin(g2, func(s cuda.Stream) bool { return s == 2 }, mk))
	require.Equal(t, g2, r.Route(2, 0, mk).ID, "both accept stream 2: the newer wins")
	require.Equal(t, g1, r.Route(1, 0, mk).ID)
	require.Nil(t, r.Route(3, 0, mk))
	require.NoError(t, r.End(g2))
	require.Equal(t, g1, r.Route(2, 0, mk).ID)
	require.ErrorIs(t, r.End(g2), graphs.ErrNotRecording)
	require.Equal(t, []pools.PoolID{g1}, r.Recording())
}

// Announced counts the announced captures, Recording names their pools in
// begin order; an ended one leaves.
func TestAnnouncedInBeginOrder(t *testing.T) {
	var r graphs.Router
	g1, g2, g3 := pools.PoolID{A: 1}, pools.PoolID{A: 2}, pools.PoolID{A: 3}
	require.NoError(t, r.Begin(g1, nil, mk))
	require.NoError(t, r.Begin(g2, nil, mk))
	require.NoError(t, r.Begin(g3, nil, mk))
	require.Equal(t, []pools.PoolID{g1, g2, g3}, r.Recording())
	require.NoError(t, r.End(g2))
	require.Equal(t, []pools.PoolID{g1, g3}, r.Recording())
	require.Equal(t, 2, r.Announced())
}

// One routing per pool at a time, as in PyTorch: a second begin of a pool
// that is being allocated to (a nested use_mem_pool of the same pool, or a
// second thread in it) is refused and leaves the use count alone; other
// pools nest, the newest winning.
func TestOneRoutingPerPool(t *testing.T) {
	var r graphs.Router
	g, h := pools.PoolID{B: 3}, pools.PoolID{B: 4}
	require.NoError(t, r.Begin(g, nil, mk))
	require.ErrorIs(t, r.Begin(g, func(cuda.Stream) bool { return true }, mk), graphs.ErrAlreadyRecording)
	require.Equal(t, 1, r.Pools.Get(g).UseCount, "the refused begin holds nothing")
	require.Equal(t, 1, r.Count())
	require.NoError(t, r.Begin(h, nil, mk), "another pool nests")
	require.Equal(t, h, r.Route(5, 0, mk).ID, "the newest routing wins")
	require.NoError(t, r.End(h))
	require.Equal(t, g, r.Route(5, 0, mk).ID)
	require.NoError(t, r.End(g))
	require.ErrorIs(t, r.End(g), graphs.ErrNotRecording)
	require.Zero(t, r.Count())
}

func TestBeginRefusals(t *testing.T) {
	var r graphs.Router
	require.ErrorIs(t, r.Begin(pools.PoolID{}, nil, mk), privatepool.ErrUnknownPool, "the default pool")
	auto := r.Route(7, 9, mk)
	require.ErrorIs(t, r.Begin(auto.ID, nil, mk), privatepool.ErrUnknownPool, "an automatic pool")
	require.Equal(t, 1, auto.UseCount, "unchanged")
	require.Equal(t, 1, r.Count(), "only the unannounced capture")
}

func TestSharingAndRelease(t *testing.T) {
	var r graphs.Router
	g := pools.PoolID{B: 5}
	require.NoError(t, r.Begin(g, nil, mk))
	require.NoError(t, r.End(g))
	require.NoError(t, r.Begin(g, nil, mk)) // a second graph shares it
	require.NoError(t, r.End(g))
	p := r.Pools.Get(g)
	require.Equal(t, 2, p.UseCount)
	require.NoError(t, r.Release(g))
	require.Empty(t, r.Pools.Freeable())
	require.NoError(t, r.Release(g))
	require.Equal(t, []*privatepool.Pool{p}, r.Pools.Freeable())
	r.Pools.Drop(p)
	require.ErrorIs(t, r.Release(g), privatepool.ErrUnknownPool)
}

func TestUnannouncedCaptures(t *testing.T) {
	var r graphs.Router
	p := r.Route(7, 42, mk)
	require.NotNil(t, p)
	require.True(t, p.Auto)
	require.Equal(t, graphs.AutoPoolID(42), p.ID)
	require.Same(t, p, r.Route(7, 42, mk))
	require.Equal(t, 1, r.Count())
	status := cuda.CaptureActive
	query := func(cuda.Stream) (cuda.CaptureStatus, uint64, error) { return status, 42, nil }
	require.True(t, r.Underway(query))
	status = cuda.CaptureNone
	require.False(t, r.Underway(query), "the capture ended")
	require.Zero(t, r.Count())
	require.Same(t, p, r.Pools.Get(graphs.AutoPoolID(42)), "the pool is kept")
	require.False(t, p.Freeable())
	require.ErrorIs(t, r.Release(p.ID), privatepool.ErrUnknownPool, "nobody may release an automatic pool")
}

func TestUnderwayQueryErrorIsConservative(t *testing.T) {
	var r graphs.Router
	r.Route(7, 1, mk)
	require.True(t, r.Underway(func(cuda.Stream) (cuda.CaptureStatus, uint64, error) {
		return 0, 0, cuda.ErrUnknown
	}), "an unexplained error: assume the capture still runs")
	require.False(t, r.Underway(func(cuda.Stream) (cuda.CaptureStatus, uint64, error) {
		return 0, 0, cuda.ErrInvalidHandle
	}), "the stream was destroyed: its capture is over")
	require.Zero(t, r.Count())
}
