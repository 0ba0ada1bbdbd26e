// SPDX-License-Identifier: Apache-2.0

// Package privatepool keeps the private memory pools that CUDA graphs
// allocate from.
//
// A graph's replays write into the memory its capture allocated, so that
// memory must not be handed to anything else while the graph lives, even
// after the capture has freed it. A private pool is a pair of block pools
// (small, large) that only its captures allocate from. Its use count is the
// number of captures and graphs holding it (begin increments, release
// decrements). At zero the pool becomes freeable: its cached segments go back
// to the driver at the next empty_cache or OOM retry, and the pool disappears
// once it has no segments left. Blocks still allocated from it come back to it
// when freed and leave with its last segment.
//
// User pools (torch.cuda.MemPool) are the same thing: creating one holds it
// (CreateOrIncref, use count 1), each use_mem_pool block holds it once more
// while it runs (begin, then end and release), and destroying it releases
// it. Such a pool may refuse to split its blocks (no_split), may lend its
// cached blocks to the default pools as a last resort before an
// out-of-memory error (use_on_oom), and may get its segments from a source
// of its own instead of the driver (Source).
//
// What a pool's lifetime allows is decided here: which pools a caller may
// name (Known), restore a checkpoint into (Restorable), or forget (Drop);
// checkpoints of a pool's layout are in checkpoint.go.
//
// A Registry belongs to one device and is guarded by that device's lock.
package privatepool

import (
	"cmp"
	"errors"
	"fmt"
	"slices"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// ErrUnknownPool is returned for an id that names no live private pool.
var ErrUnknownPool = errors.New("unknown memory pool")

// SegmentSource supplies a private pool's segments instead of the driver
// (MemPool(allocator=X)). Its methods are called with the device's lock
// held, so they must not call back into the allocator.
type SegmentSource interface {
	// Alloc is called in relaxed capture mode like driver allocations;
	// return an error wrapping cuda.ErrOutOfMemory for OOM.
	Alloc(dev int, size uint64, s cuda.Stream) (cuda.Ptr, error)
	Free(dev int, p cuda.Ptr, size uint64) error
}

// refusal is a lifetime rule's refusal of a pool (ErrUnknownPool); its
// message is the whole explanation.
type refusal struct{ msg string }

func (e *refusal) Error() string { return e.msg }
func (e *refusal) Unwrap() error { return ErrUnknownPool }

func refuse(format string, args ...any) error { return &refusal{fmt.Sprintf(format, args...)} }

// Pool is one private pool.
type Pool struct {
	ID       pools.PoolID
	UseCount int
	Small    *pools.BlockPool
	Large    *pools.BlockPool
	// Auto marks a pool made for a capture nobody announced; it is never
	// released because nobody will say when its graph dies.
	Auto bool
	// NoSplit: the pool's blocks are never split (MemPool(no_split=True));
	// set on both block pools, where the split decision reads it.
	NoSplit bool
	// UseOnOOM: a request of the default pools that finds no memory may
	// take a cached block of this pool before anything is freed
	// (MemPool(use_on_oom=True)).
	UseOnOOM bool
	// Serial is a number no other pool of the registry has had (from 1):
	// it names this pool where a pointer cannot (the front cache's tags).
	Serial uint32
	// Source supplies the pool's segments (nil: the driver); set before
	// the pool holds any, since each segment goes back where it came from.
	Source SegmentSource
}

// SetNoSplit makes the pool hand out whole blocks from now on.
func (p *Pool) SetNoSplit() {
	p.NoSplit = true
	p.Small.NoSplit, p.Large.NoSplit = true, true
}

// Segments is the number of segments the pool holds.
func (p *Pool) Segments() int { return p.Small.Segments + p.Large.Segments }

// Freeable reports whether every holder has released the pool.
func (p *Pool) Freeable() bool { return p.UseCount == 0 && !p.Auto }

// Registry maps ids to a device's private pools.
type Registry struct {
	pools  map[pools.PoolID]*Pool
	serial uint32 // the last pool's Serial
	// released counts the pools at use count 0 (Freeable), so that
	// empty_cache with none skips a walk over every pool.
	released int
	made     []Pool // made ahead, for the next pools
}

// NewPools makes the two block pools of a new private pool.
type NewPools func(id pools.PoolID) (small, large *pools.BlockPool)

// Get returns the pool with the given id, or nil.
func (r *Registry) Get(id pools.PoolID) *Pool { return r.pools[id] }

// Acquire returns the pool with the given id, creating it with use count 1,
// or adds a user to an existing one (pool sharing between captures). A
// freeable pool that is acquired again becomes live again.
func (r *Registry) Acquire(id pools.PoolID, mk NewPools) *Pool {
	if p := r.pools[id]; p != nil {
		if p.UseCount == 0 {
			r.released--
		}
		p.UseCount++
		return p
	}
	if r.pools == nil {
		r.pools = make(map[pools.PoolID]*Pool)
	}
	small, large := mk(id)
	r.serial++
	if len(r.made) == 0 {
		r.made = make([]Pool, poolBatch)
	}
	p := &r.made[0]
	r.made = r.made[1:]
	*p = Pool{ID: id, UseCount: 1, Small: small, Large: large, Serial: r.serial}
	r.pools[id] = p
	return p
}

// poolBatch is how many Pools Acquire makes at a time: a capture's begin
// hook runs with cold caches, where each object from Go's allocator costs
// about a microsecond (pools.Cache.NewPool says more).
const poolBatch = 8

// Incref is Acquire for a caller that names the pool (a capture, a
// MemPool): it refuses the default pool and the automatic pools of
// unannounced captures, which no caller may hold.
func (r *Registry) Incref(id pools.PoolID, mk NewPools) (*Pool, error) {
	if id.IsDefault() {
		return nil, fmt.Errorf("%w: {0,0} is the default pool, not a private one", ErrUnknownPool)
	}
	if p := r.pools[id]; p != nil && p.Auto {
		return nil, fmt.Errorf("%w {%d,%d}: the automatic pool of an unannounced capture", ErrUnknownPool, id.A, id.B)
	}
	return r.Acquire(id, mk), nil
}

// UseCount returns the number of holders of the pool id, 0 for a released
// pool that still holds memory, or an error for an unknown pool.
func (r *Registry) UseCount(id pools.PoolID) (int, error) {
	p := r.pools[id]
	if p == nil {
		return 0, fmt.Errorf("%w {%d,%d}", ErrUnknownPool, id.A, id.B)
	}
	return p.UseCount, nil
}

// UseOnOOM returns the live pools marked use_on_oom, ordered by id.
func (r *Registry) UseOnOOM() []*Pool {
	var out []*Pool
	for _, p := range r.pools {
		if p.UseOnOOM && !p.Freeable() {
			out = append(out, p)
		}
	}
	sortByID(out)
	return out
}

// Release drops one user of the pool. At zero the pool becomes freeable.
func (r *Registry) Release(id pools.PoolID) error {
	p := r.pools[id]
	if p == nil || p.Auto {
		return fmt.Errorf("%w {%d,%d}", ErrUnknownPool, id.A, id.B)
	}
	if p.UseCount == 0 {
		return fmt.Errorf("%w {%d,%d}: already released by all its users", ErrUnknownPool, id.A, id.B)
	}
	p.UseCount--
	if p.UseCount == 0 {
		r.released++
	}
	return nil
}

// Freeable returns the pools no one holds, ordered by id.
func (r *Registry) Freeable() []*Pool {
	if r.released == 0 {
		return nil
	}
	var out []*Pool
	for _, p := range r.pools {
		if p.Freeable() {
			out = append(out, p)
		}
	}
	sortByID(out)
	return out
}

// sortByID sorts ps by pool id. slices.SortFunc, unlike sort.Slice, needs no
// reflection and no allocation (empty_cache calls Freeable).
func sortByID(ps []*Pool) {
	slices.SortFunc(ps, func(a, b *Pool) int {
		return cmp.Or(cmp.Compare(a.ID.A, b.ID.A), cmp.Compare(a.ID.B, b.ID.B))
	})
}

// Known returns pool id of device dev, which must exist (held or not) and
// not be the automatic pool of an unannounced capture, which no caller
// names.
func (r *Registry) Known(dev int, id pools.PoolID) (*Pool, error) {
	p := r.pools[id]
	if p == nil || p.Auto {
		return nil, refuse("device %d has no pool {%d,%d} (create it first)", dev, id.A, id.B)
	}
	return p, nil
}

// Existing returns pool id of device dev, automatic pools included.
func (r *Registry) Existing(dev int, id pools.PoolID) (*Pool, error) {
	p := r.pools[id]
	if p == nil {
		return nil, refuse("device %d has no private pool {%d,%d}", dev, id.A, id.B)
	}
	return p, nil
}

// Restorable returns pool id of device dev if a checkpoint may be
// restored into it: it exists, is held (a restore into a released pool
// would allocate in it again), and is not the automatic pool of an
// unannounced capture (its capture may be under way, and nothing says when
// it is not).
func (r *Registry) Restorable(dev int, id pools.PoolID) (*Pool, error) {
	p, err := r.Existing(dev, id)
	switch {
	case err != nil:
		return nil, err
	case p.Freeable():
		return nil, refuse("pool {%d,%d} on device %d was released by all its holders; a checkpoint cannot be restored into it", id.A, id.B, dev)
	case p.Auto:
		return nil, refuse("pool {%d,%d} on device %d is the automatic pool of an unannounced capture; a checkpoint cannot be restored into it", id.A, id.B, dev)
	}
	return p, nil
}

// Drop forgets a freeable pool that has no segments left.
func (r *Registry) Drop(p *Pool) {
	if !p.Freeable() || p.Segments() != 0 {
		panic("privatepool: dropping a pool that is held or holds memory")
	}
	delete(r.pools, p.ID)
	r.released--
	// From a batch (Acquire): lets its block pools and source go with it.
	p.Small, p.Large, p.Source = nil, nil, nil
}

// Check verifies the count of released pools against the pools.
func (r *Registry) Check() error {
	n := 0
	for _, p := range r.pools {
		if p.Freeable() {
			n++
		}
	}
	if n != r.released {
		return fmt.Errorf("privatepool: %d pools released, %d counted", n, r.released)
	}
	return nil
}

// Released is the number of pools every holder has released (Freeable).
func (r *Registry) Released() int { return r.released }

// Len is the number of pools, live or freeable.
func (r *Registry) Len() int { return len(r.pools) }

// Each calls fn for every pool.
func (r *Registry) Each(fn func(*Pool)) {
	for _, p := range r.pools {
		fn(p)
	}
}
