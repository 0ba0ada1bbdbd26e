// SPDX-License-Identifier: Apache-2.0

package privatepool_test

import (
	"math/rand/v2"
	"testing"

	"github.com/cudapool/cudapool/cuda"
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

// What a pool's lifetime allows: naming it (Known: not an automatic pool),
// looking at it (Existing) and restoring into it (Restorable: held, not
// automatic); refusals are ErrUnknownPool and say which rule.
func TestLifetimeRules(t *testing.T) {
	var r privatepool.Registry
	held, released, auto, none := pools.PoolID{A: 1}, pools.PoolID{B: 2}, pools.PoolID{A: 1 << 63}, pools.PoolID{A: 9}
	r.Acquire(held, mk)
	r.Acquire(released, mk)
	require.NoError(t, r.Release(released))
	r.Acquire(auto, mk).Auto = true

	for _, tc := range []struct {
		name string
		fn   func(int, pools.PoolID) (*privatepool.Pool, error)
		id   pools.PoolID
		msg  string // "" : allowed
	}{
		{"known held", r.Known, held, ""},
		{"known released", r.Known, released, ""},
		{"known automatic", r.Known, auto, "device 3 has no pool {9223372036854775808,0} (create it first)"},
		{"known none", r.Known, none, "device 3 has no pool {9,0} (create it first)"},
		{"existing automatic", r.Existing, auto, ""},
		{"existing none", r.Existing, none, "device 3 has no private pool {9,0}"},
		{"restorable held", r.Restorable, held, ""},
		{"restorable released", r.Restorable, released, "pool {0,2} on device 3 was released by all its holders"},
		{"restorable automatic", r.Restorable, auto, "is the automatic pool of an unannounced capture"},
		{"restorable none", r.Restorable, none, "device 3 has no private pool {9,0}"},
	} {
		p, err := tc.fn(3, tc.id)
		if tc.msg == "" {
			require.NoError(t, err, tc.name)
			require.Same(t, r.Get(tc.id), p, tc.name)
			continue
		}
		require.Nil(t, p, tc.name)
		require.ErrorIs(t, err, privatepool.ErrUnknownPool, tc.name)
		require.ErrorContains(t, err, tc.msg, tc.name)
	}
}

// A checkpoint of a pool's layout, restored after the pool changed: the
// blocks allocated since are freed, the checkpoint's allocated again.
func TestCheckpointRestore(t *testing.T) {
	c := pools.NewCache(pools.DefaultConfig())
	var r privatepool.Registry
	p := r.Acquire(pools.PoolID{A: 1}, func(id pools.PoolID) (*pools.BlockPool, *pools.BlockPool) {
		return c.NewPool(true, id), c.NewPool(false, id)
	})
	alloc := func(size uint64) *pools.Block {
		var req pools.Request
		c.SetRequest(&req, size, 1, p.Small, p.Large)
		b := c.TakeFree(&req)
		if b == nil {
			b = c.AddSegment(&req, cuda.Ptr(0x100000*(1+uint64(len(c.Segments())))))
		}
		return c.Allocate(&req, b)
	}
	x := alloc(4096)
	xp := x.Ptr
	cp, err := privatepool.Save(c, 0, p)
	require.NoError(t, err)
	require.Equal(t, []cuda.Ptr{x.Ptr}, cp.Allocated())
	require.Equal(t, pools.PoolID{A: 1}, cp.Pool())
	c.Release(x)
	c.Return(x)
	y := alloc(8192)
	yp := y.Ptr // (blocks are recycled: keep the addresses)
	require.True(t, privatepool.Live(c, p, map[cuda.Ptr]struct{}{yp: {}}))
	require.False(t, privatepool.Live(c, p, map[cuda.Ptr]struct{}{yp + 1: {}}))

	var freed, allocated []*pools.Block
	fp, ap, err := privatepool.Restore(c, p, cp, func(b *pools.Block) {
		freed = append(freed, b)
		c.Release(b)
		c.Return(b)
	}, func(b *pools.Block) { allocated = append(allocated, b) })
	require.NoError(t, err)
	require.Equal(t, []cuda.Ptr{yp}, fp)
	require.Equal(t, []cuda.Ptr{xp}, ap)
	require.Len(t, freed, 1)
	require.Len(t, allocated, 1)
	require.Equal(t, uint64(4096), allocated[0].Requested)
	require.True(t, privatepool.Live(c, p, map[cuda.Ptr]struct{}{xp: {}}))
	require.NoError(t, c.Check())
}
