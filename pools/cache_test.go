// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"errors"
	"testing"

	"github.com/cudapool/cudapool/cuda"
	"github.com/stretchr/testify/require"
)

const (
	KiB = 1 << 10
	MiB = 1 << 20
)

func TestRoundSize(t *testing.T) {
	def := DefaultConfig()
	div4 := DefaultConfig()
	for i := range div4.RoundupDivisions {
		div4.RoundupDivisions[i] = 4
	}
	for _, tc := range []struct {
		cfg        *Config
		size, want uint64
	}{
		{&def, 1, 512},
		{&def, 511, 512},
		{&def, 512, 512},
		{&def, 513, 1024},
		{&def, 1000 * KiB, 1000 * KiB},
		{&def, 1000*KiB + 1, 1000*KiB + 512},
		{&div4, 1200 * KiB, 1280 * KiB}, // 1 MiB..2 MiB in quarter steps
		{&div4, 1 * MiB, 1 * MiB},       // powers of two stay
		{&div4, 5*MiB + 1, 6 * MiB},     // 4..8 MiB: steps of 1 MiB
		{&div4, 1500, 1536},             // below 512*4: plain rounding
		{&div4, 3000, 3072},             // 2048..4096 in steps of 512
		{&div4, 100*MiB + 7, 112 * MiB}, // 64..128 MiB: steps of 16
	} {
		require.Equal(t, tc.want, tc.cfg.RoundSize(tc.size), "size %d", tc.size)
	}
}

func TestSegmentSizeAndPool(t *testing.T) {
	cfg := DefaultConfig()
	for _, tc := range []struct {
		size, seg uint64
		small     bool
	}{
		{512, 2 * MiB, true},
		{1 * MiB, 2 * MiB, true},
		{1*MiB + 512, 20 * MiB, false},
		{10*MiB - 512, 20 * MiB, false},
		{10 * MiB, 10 * MiB, false},
		{11*MiB + 1, 12 * MiB, false},
		{100 * MiB, 100 * MiB, false},
	} {
		require.Equal(t, tc.seg, cfg.SegmentSize(tc.size), "size %d", tc.size)
		require.Equal(t, tc.small, IsSmall(tc.size), "size %d", tc.size)
	}
}

// harness drives a Cache the way the allocator does, with fake segments.
type harness struct {
	t     *testing.T
	c     *Cache
	next  cuda.Ptr
	freed []cuda.Ptr
}

func newHarness(t *testing.T, cfg Config) *harness {
	return &harness{t: t, c: NewCache(cfg), next: 1 << 40}
}

func (h *harness) free(base cuda.Ptr, size uint64) error {
	h.freed = append(h.freed, base)
	return nil
}

// malloc returns the block for size on stream s, growing with a new segment
// when nothing cached fits.
func (h *harness) malloc(size uint64, s cuda.Stream) *Block {
	r := h.c.NewRequest(size, s, h.c.Small, h.c.Large)
	b := h.c.TakeFree(&r)
	if b == nil {
		b = h.c.AddSegment(&r, h.next)
		h.next += cuda.Ptr(r.SegSize) + 2*MiB
	}
	b = h.c.Allocate(&r, b)
	require.NoError(h.t, h.c.Check())
	return b
}

func (h *harness) freeBlock(b *Block) {
	h.c.Release(b)
	h.c.Return(b)
	require.NoError(h.t, h.c.Check())
}

func cur(a StatArray, t int) int64 { return a[t].Current }

func TestSplitAndMergeStats(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	st := h.c.ReadStats // read again after each change

	a := h.malloc(1000, 0) // small: 2 MiB segment split into 1024 + rest
	require.Equal(t, uint64(1024), a.Size)
	require.Equal(t, int64(1), cur(st().Segment, StatSmall))
	require.Equal(t, int64(2*MiB), cur(st().ReservedBytes, StatSmall))
	require.Equal(t, int64(1024), cur(st().AllocatedBytes, StatAll))
	require.Equal(t, int64(1000), cur(st().RequestedBytes, StatSmall))
	require.Equal(t, int64(1), cur(st().InactiveSplit, StatSmall))
	require.Equal(t, int64(2*MiB-1024), cur(st().InactiveSplitBytes, StatSmall))

	b := h.malloc(3000, 0) // from the same segment, right after a
	require.Equal(t, a.End(), b.Ptr)
	require.Equal(t, int64(1), cur(st().Segment, StatSmall), "no new segment")
	require.Equal(t, int64(2*MiB-1024-3072), cur(st().InactiveSplitBytes, StatSmall))

	h.freeBlock(a) // a is free and split, not merged (b is allocated)
	require.Equal(t, int64(2), cur(st().InactiveSplit, StatSmall))
	require.Equal(t, int64(2*MiB-3072), cur(st().InactiveSplitBytes, StatSmall))

	h.freeBlock(b) // merges with both neighbours: the whole segment is free
	require.Equal(t, int64(0), cur(st().InactiveSplit, StatAll))
	require.Equal(t, int64(0), cur(st().InactiveSplitBytes, StatAll))
	require.Equal(t, 1, h.c.Small.Blocks.Len())
	seg := h.c.Small.Blocks.LowerBound(0, 0)
	require.Equal(t, uint64(2*MiB), seg.Size)
	require.False(t, seg.IsSplit())
	require.Equal(t, int64(2), st().Allocation[StatAll].Allocated)
	require.Equal(t, int64(2), st().Allocation[StatAll].Freed)
	require.Equal(t, int64(4096), st().AllocatedBytes[StatAll].Peak)
	require.Equal(t, 2, h.c.SpareBlocks(), "split blocks are recycled")
}

func TestStreamIsolation(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	a := h.malloc(4096, 1)
	h.freeBlock(a)
	b := h.malloc(4096, 2)
	require.NotEqual(t, a.Seg, b.Seg, "a block freed on stream 1 is not reused by stream 2")
	c := h.malloc(4096, 1)
	require.Equal(t, h.c.Stats.Segment[StatAll].Current, int64(2))
	require.Equal(t, cuda.Stream(1), c.Stream)
}

func TestLargePoolSplitRules(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	a := h.malloc(5*MiB, 0) // 20 MiB segment: 15 MiB remain, split
	require.Equal(t, uint64(5*MiB), a.Size)
	require.True(t, a.IsSplit())
	b := h.malloc(14*MiB+512*KiB, 0) // leaves 512 KiB: not > 1 MiB, no split
	require.Equal(t, uint64(15*MiB), b.Size, "a large block keeps a remainder of <= 1 MiB")
	require.Equal(t, uint64(14*MiB+512*KiB), b.Requested)
	require.Equal(t, int64(1), h.c.Stats.Segment[StatLarge].Current)
}

func TestMaxSplitSize(t *testing.T) {
	cfg := DefaultConfig()
	cfg.MaxSplitSize = 40 * MiB
	h := newHarness(t, cfg)
	big := h.malloc(64*MiB, 0)
	require.False(t, big.IsSplit(), "blocks >= max_split_size are not split")
	require.Equal(t, int64(1), h.c.Stats.OversizeAllocations.Current)
	require.Equal(t, int64(1), h.c.Stats.OversizeSegments.Current)
	h.freeBlock(big)
	require.Equal(t, int64(0), h.c.Stats.OversizeAllocations.Current)

	small := h.malloc(12*MiB, 0)
	require.NotEqual(t, big.Seg, small.Seg, "an oversize block is not given to a request below max_split_size")
	over := h.malloc(70*MiB, 0)
	require.NotEqual(t, big.Ptr, over.Ptr, "64 MiB block is too small")
	h.freeBlock(over)
	reuse := h.malloc(60*MiB, 0)
	require.Equal(t, uint64(64*MiB), reuse.Size, "a request >= max_split takes a block at most 20 MiB larger")
	h.freeBlock(reuse)
	fit := h.malloc(48*MiB, 0)
	require.Equal(t, uint64(64*MiB), fit.Size, "64 MiB < 48+20 MiB: the cached block is reused whole")
	fresh := h.malloc(40*MiB, 0)
	require.Equal(t, uint64(40*MiB), fresh.Seg.Size, "70 MiB >= 40+20 MiB: a new segment instead")
}

func TestReleaseAvailable(t *testing.T) {
	cfg := DefaultConfig()
	cfg.MaxSplitSize = 30 * MiB
	h := newHarness(t, cfg)
	var bs []*Block
	for _, sz := range []uint64{40 * MiB, 50 * MiB, 60 * MiB} {
		bs = append(bs, h.malloc(sz, 0))
	}
	for _, b := range bs {
		h.freeBlock(b)
	}
	// A single cached block large enough: only it goes.
	r := h.c.NewRequest(45*MiB, 0, h.c.Small, h.c.Large)
	ok, err := h.c.ReleaseAvailable(&r, h.free)
	require.NoError(t, err)
	require.True(t, ok)
	require.Len(t, h.freed, 1)
	require.Equal(t, int64(2), h.c.Stats.Segment[StatAll].Current)
	require.NoError(t, h.c.Check())
	// None large enough: the largest go first until the sum covers it.
	r = h.c.NewRequest(100*MiB, 0, h.c.Small, h.c.Large)
	ok, err = h.c.ReleaseAvailable(&r, h.free)
	require.NoError(t, err)
	require.True(t, ok, "60 then 40 MiB, largest first, cover 100 MiB")
	require.Len(t, h.freed, 3)
	require.Zero(t, h.c.Reserved)
	require.NoError(t, h.c.Check())
	// Nothing cached on another stream helps.
	h.freeBlock(h.malloc(40*MiB, 0))
	r = h.c.NewRequest(35*MiB, 7, h.c.Small, h.c.Large)
	ok, err = h.c.ReleaseAvailable(&r, h.free)
	require.NoError(t, err)
	require.False(t, ok)
	require.Len(t, h.freed, 3)
}

func TestReleasePoolOnlyWholeSegments(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	a := h.malloc(4096, 0)
	b := h.malloc(4096, 0)
	c := h.malloc(2*MiB, 0) // large pool, 20 MiB segment
	h.freeBlock(a)
	h.freeBlock(c)
	require.NoError(t, h.c.ReleasePool(h.c.Small, h.free))
	require.NoError(t, h.c.ReleasePool(h.c.Large, h.free))
	require.Len(t, h.freed, 1, "the small segment still holds b")
	require.Equal(t, int64(1), h.c.Stats.Segment[StatAll].Current)
	require.Equal(t, int64(1), h.c.Stats.NumDeviceFree)
	require.Equal(t, uint64(2*MiB), h.c.Reserved)
	h.freeBlock(b)
	require.NoError(t, h.c.ReleasePool(h.c.Small, h.free))
	require.Zero(t, h.c.Reserved)
	require.NoError(t, h.c.Check())
}

// ReleasePool walks the free set only while the pool may hold something to
// give back (BlockPool.Releasable): set by every insert, cleared by
// MarkReleased after a release that gave everything back; a failed release
// leaves it set, and Check catches a flag cleared too early.
func TestReleasableFlag(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	a := h.malloc(4096, 0)
	b := h.malloc(4096, 0)
	h.freeBlock(a)
	require.True(t, h.c.Small.Releasable())
	require.NoError(t, h.c.ReleasePool(h.c.Small, h.free))
	require.True(t, h.c.Small.Releasable(), "only MarkReleased clears it")
	h.c.MarkReleased(h.c.Small)
	require.False(t, h.c.Small.Releasable())
	require.NoError(t, h.c.Check(), "a split segment's free block is not whole")

	// A free that makes the segment whole sets the flag; a failing release
	// keeps it, so that the retry still gives the segment back.
	h.freeBlock(b)
	require.True(t, h.c.Small.Releasable())
	boom := errors.New("boom")
	require.ErrorIs(t, h.c.ReleasePool(h.c.Small, func(cuda.Ptr, uint64) error { return boom }), boom)
	require.True(t, h.c.Small.Releasable())
	require.NoError(t, h.c.Check())

	// Cleared while the whole segment is still cached: Check says so.
	h.c.MarkReleased(h.c.Small)
	require.ErrorContains(t, h.c.Check(), "releasable")
	require.NoError(t, h.c.ReleasePool(h.c.Small, h.free))
	require.NotZero(t, h.c.Reserved, "a pool not flagged is not walked")
	h.c.Small.SetReleasable()
	require.NoError(t, h.c.ReleasePool(h.c.Small, h.free))
	h.c.MarkReleased(h.c.Small)
	require.Zero(t, h.c.Reserved)
	require.Len(t, h.freed, 1)
	require.NoError(t, h.c.Check())
}

func TestMemoryFraction(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	h.c.SetFraction(0.5, 100*MiB)
	require.True(t, h.c.CanGrow(50*MiB))
	require.False(t, h.c.CanGrow(50*MiB+1))
	h.malloc(40*MiB, 0)
	require.True(t, h.c.CanGrow(10*MiB))
	require.False(t, h.c.CanGrow(12*MiB))
	allowed, ok := h.c.Allowed()
	require.True(t, ok)
	require.Equal(t, uint64(50*MiB), allowed)
	f, ok := h.c.Fraction()
	require.True(t, ok)
	require.Equal(t, 0.5, f, "the fraction as set, not as rounded to bytes")

	h.c.SetFraction(1, 100*MiB) // PyTorch: 1 is no limit at all
	_, ok = h.c.Allowed()
	require.False(t, ok)
	_, ok = h.c.Fraction()
	require.False(t, ok)
	require.True(t, h.c.CanGrow(1<<40))
}

func TestGarbageCollection(t *testing.T) {
	cfg := DefaultConfig()
	cfg.GCThreshold = 0.5
	h := newHarness(t, cfg)
	h.c.SetFraction(0.5, 400*MiB) // threshold: half of 200 MiB
	var old []*Block
	for i := 0; i < 4; i++ {
		old = append(old, h.malloc(30*MiB, 0))
	}
	for _, b := range old {
		h.freeBlock(b)
	}
	// Age the cached blocks: searches that miss them advance the clock.
	for i := 0; i < 5; i++ {
		h.freeBlock(h.malloc(2*MiB, 0))
	}
	require.Greater(t, h.c.Large.FreeCalls(), uint64(0), "GC on: searches are counted")
	reservedBefore := h.c.Reserved
	require.Greater(t, reservedBefore, uint64(100*MiB))
	require.NoError(t, h.c.GarbageCollect(h.free))
	require.NotEmpty(t, h.freed)
	require.LessOrEqual(t, h.c.Reserved, uint64(100*MiB), "GC frees down to the threshold")
	require.NoError(t, h.c.Check())

	off := newHarness(t, cfg) // no fraction set: GC is off
	off.freeBlock(off.malloc(30*MiB, 0))
	require.NoError(t, off.c.GarbageCollect(off.free))
	require.Empty(t, off.freed)
	off.c.SetFraction(1, 20*MiB) // fraction 1 is no limit: GC stays off
	require.NoError(t, off.c.GarbageCollect(off.free))
	require.Empty(t, off.freed)
}

func TestStatsKeys(t *testing.T) {
	var s Stats
	keys := map[string]bool{}
	s.Each(func(k string, _ int64) {
		require.False(t, keys[k], "duplicate key %s", k)
		keys[k] = true
	})
	require.Len(t, keys, 122)
	for _, k := range []string{"allocated_bytes.all.current", "requested_bytes.small_pool.freed",
		"inactive_split_bytes.large_pool.peak", "oversize_segments.allocated", "num_device_free", "max_split_size"} {
		require.True(t, keys[k], k)
	}
}

func TestResetStats(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	b := h.malloc(8*MiB, 0)
	h.freeBlock(b)
	h.malloc(4096, 0)
	require.Equal(t, int64(8*MiB), h.c.ReadStats().AllocatedBytes[StatAll].Peak)
	h.c.ResetPeak()
	require.Equal(t, int64(4096), h.c.ReadStats().AllocatedBytes[StatAll].Peak)
	h.c.ResetAccumulated()
	st := h.c.ReadStats()
	require.Zero(t, st.AllocatedBytes[StatAll].Allocated)
	require.Zero(t, st.AllocatedBytes[StatAll].Freed)
	require.Zero(t, st.NumDeviceAlloc)
	require.Equal(t, int64(4096), st.AllocatedBytes[StatAll].Current, "current survives resets")
	h.malloc(1024, 0)
	st = h.c.ReadStats()
	require.Equal(t, int64(1024), st.AllocatedBytes[StatSmall].Allocated, "increases after the reset")
	require.Equal(t, int64(4096+1024), st.AllocatedBytes[StatAll].Current)
	require.NoError(t, h.c.Check())
}

func TestCheckCatchesCorruption(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	b := h.malloc(4096, 0)
	h.c.CorruptAllAllocatedBytes(1)
	require.ErrorContains(t, h.c.Check(), "allocated_bytes")
	h.c.CorruptAllAllocatedBytes(-1)
	b.Size += 512
	require.Error(t, h.c.Check(), "a block that overlaps its neighbour")
	b.Size -= 512
	require.NoError(t, h.c.Check())
}

// NewPool's batches hold sets of the configured kind, and a new kind
// starts a new batch; no pool is handed out twice.
func TestNewPoolBatches(t *testing.T) {
	cfg := DefaultConfig()
	cfg.FreeSet = FreeSetTreap
	c := NewCache(cfg)
	seen := map[*BlockPool]bool{c.Small: true, c.Large: true}
	for i := 0; i < 3*poolBatch; i++ {
		p := c.NewPool(i%2 == 0, PoolID{A: uint64(i + 1)})
		require.False(t, seen[p], "pool %d handed out twice", i)
		seen[p] = true
		require.IsType(t, &treap{}, p.Blocks)
		require.IsType(t, &treap{}, p.Unmapped)
		require.Equal(t, PoolID{A: uint64(i + 1)}, p.ID)
		require.Equal(t, i%2 == 0, p.Small)
	}
	cfg.FreeSet = FreeSetSorted
	c.SetConfig(cfg)
	p := c.NewPool(false, PoolID{A: 99})
	require.IsType(t, &sortedSet{}, p.Blocks)
	require.NotSame(t, p.Blocks, p.Unmapped)
}
