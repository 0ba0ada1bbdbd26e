package privatepool_test

import (
	"math/rand/v2"
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
	for _, id := range []pools.PoolID{{A: 3}, {A: 1, B: 2}, {B: 1}, {A: 1}} {
		r.Acquire(id, mk)
		require.NoError(t, r.Release(id))
	}
	var ids []pools.PoolID
	for _, p := range r.Freeable() {
		ids = append(ids, p.ID)
	}
	require.Equal(t, []pools.PoolID{{B: 1}, {A: 1}, {A: 1, B: 2}, {A: 3}}, ids)
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

func TestIncrefAndUseCount(t *testing.T) {
	var r privatepool.Registry
	id := pools.PoolID{B: 7}
	_, err := r.UseCount(id)
	require.ErrorIs(t, err, privatepool.ErrUnknownPool, "unknown pool: an error, as PyTorch asserts")
	p, err := r.Incref(id, mk)
	require.NoError(t, err)
	n, err := r.UseCount(id)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	q, err := r.Incref(id, mk)
	require.NoError(t, err)
	require.Same(t, p, q)
	require.NoError(t, r.Release(id))
	require.NoError(t, r.Release(id))
	n, err = r.UseCount(id)
	require.NoError(t, err)
	require.Zero(t, n, "released but not yet dropped")

	_, err = r.Incref(pools.PoolID{}, mk)
	require.ErrorIs(t, err, privatepool.ErrUnknownPool)
	auto := r.Acquire(pools.PoolID{A: 1 << 63}, mk)
	auto.Auto = true
	_, err = r.Incref(auto.ID, mk)
	require.ErrorIs(t, err, privatepool.ErrUnknownPool)
	require.Equal(t, 1, auto.UseCount)
}

func TestPoolFlags(t *testing.T) {
	var r privatepool.Registry
	a := r.Acquire(pools.PoolID{B: 2}, mk)
	b := r.Acquire(pools.PoolID{B: 1}, mk)
	c := r.Acquire(pools.PoolID{A: 1}, mk)
	a.UseOnOOM, b.UseOnOOM, c.UseOnOOM = true, true, true
	require.Equal(t, []*privatepool.Pool{b, a, c}, r.UseOnOOM(), "ordered by id")
	require.NoError(t, r.Release(b.ID))
	require.Equal(t, []*privatepool.Pool{a, c}, r.UseOnOOM(), "a released pool lends nothing")

	require.False(t, a.Small.NoSplit || a.Large.NoSplit)
	a.SetNoSplit()
	require.True(t, a.NoSplit && a.Small.NoSplit && a.Large.NoSplit)
}

// Released counts the freeable pools through any sequence of acquires,
// releases and drops (empty_cache skips the walk over the pools when it
// is zero).
func TestReleasedCount(t *testing.T) {
	var r privatepool.Registry
	rng := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 5000; i++ {
		id := pools.PoolID{A: uint64(rng.IntN(8))}
		switch p := r.Get(id); {
		case rng.IntN(3) == 0:
			r.Acquire(id, mk)
		case p != nil && p.Freeable():
			r.Drop(p)
		case p != nil:
			require.NoError(t, r.Release(id))
		}
		require.Equal(t, len(r.Freeable()), r.Released(), "step %d", i)
		require.NoError(t, r.Check(), "step %d", i)
	}
}
