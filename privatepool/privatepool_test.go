package privatepool_test

import (
	"testing"

	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/privatepool"
	"github.com/stretchr/testify/require"
)

func mk(id pools.PoolID) (*pools.BlockPool, *pools.BlockPool) {
	c := pools.NewCache(pools.DefaultConfig())
	return c.NewPool(true, id), c.NewPool(false, id)
}

func TestLifecycle(t *testing.T) {
	var r privatepool.Registry
	id := pools.PoolID{A: 1}
	p := r.Acquire(id, mk)
	require.Equal(t, 1, p.UseCount)
	require.Same(t, p, r.Acquire(id, mk))
	require.Equal(t, 2, p.UseCount)
	require.NoError(t, r.Release(id))
	require.False(t, p.Freeable())
	require.NoError(t, r.Release(id))
	require.True(t, p.Freeable())
	require.ErrorIs(t, r.Release(id), privatepool.ErrUnknownPool)

	p.Large.Segments = 1 // still holds memory
	require.Panics(t, func() { r.Drop(p) })
	p.Large.Segments = 0
	r.Drop(p)
	require.Nil(t, r.Get(id))
	require.Zero(t, r.Len())
}

func TestFreeableOrdered(t *testing.T) {
	var r privatepool.Registry
	for _, id := range []pools.PoolID{{A: 3}, {B: 1}, {A: 1}} {
		r.Acquire(id, mk)
		require.NoError(t, r.Release(id))
	}
	var ids []pools.PoolID
	for _, p := range r.Freeable() {
		ids = append(ids, p.ID)
	}
	require.Equal(t, []pools.PoolID{{B: 1}, {A: 1}, {A: 3}}, ids)
}

func TestReacquireRevives(t *testing.T) {
	var r privatepool.Registry
	id := pools.PoolID{B: 2}
	r.Acquire(id, mk)
	require.NoError(t, r.Release(id))
	p := r.Acquire(id, mk)
	require.Equal(t, 1, p.UseCount)
	require.False(t, p.Freeable())
}
