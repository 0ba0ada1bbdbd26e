package pools

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// heldHarness is a harness whose Claim gives back the blocks in front and
// refuses those in served (handed out again by the front meanwhile).
type heldHarness struct {
	*harness
	front  map[*Block]bool
	claims int
}

func newHeldHarness(t *testing.T) *heldHarness {
	h := &heldHarness{harness: newHarness(t, DefaultConfig()), front: map[*Block]bool{}}
	h.c.Claim = func(b *Block) bool {
		h.claims++
		if !h.front[b] {
			return false
		}
		delete(h.front, b)
		return true
	}
	return h
}

func (h *heldHarness) hold(b *Block) {
	h.c.CountFrontHold(b)
	h.front[b] = true
	require.NoError(h.t, h.c.Check())
}

// Best fit sees held blocks: a held block that fits better than every free
// one is claimed back and taken; a worse one is left held.
func TestHeldBestFit(t *testing.T) {
	h := newHeldHarness(t)
	big := h.malloc(100*MiB, 0) // segments of their own (large, over 10 MiB)
	mid := h.malloc(60*MiB, 0)
	h.freeBlock(big)
	h.hold(mid)
	midPtr := mid.Ptr
	b := h.malloc(50*MiB, 0)
	require.Equal(t, midPtr, b.Ptr, "the held 60 MiB block fits better than the free 100 MiB one")
	require.Equal(t, 1, h.claims)
	require.Empty(t, h.front)

	// A held block larger than a free fit stays held.
	h = newHeldHarness(t)
	large := h.malloc(100*MiB, 0)
	fit := h.malloc(60*MiB, 0)
	h.hold(large)
	fitPtr := fit.Ptr
	h.freeBlock(fit)
	got := h.malloc(55*MiB, 0)
	require.Equal(t, fitPtr, got.Ptr, "the free 60 MiB block is the better fit")
	require.Zero(t, h.claims, "nothing claimed")
	require.True(t, h.front[large] && large.Held)
}

// A block the front has handed out again is not taken: best fit drops it
// from the index and goes on (its reuse is counted when the log comes).
func TestHeldServedMeanwhile(t *testing.T) {
	h := newHeldHarness(t)
	a := h.malloc(60*MiB, 0)
	h.hold(a)
	delete(h.front, a) // the front served it
	b := h.malloc(50*MiB, 0)
	require.NotEqual(t, a.Ptr, b.Ptr, "a new segment, not the block in use")
	require.True(t, a.Held && a.Allocated, "held until its reuse is counted")
	h.c.CountFrontReuse(a)
	require.False(t, a.Held)
	require.NoError(t, h.c.Check())
}

// A block freed next to a held one claims it back and merges with it; one
// the front handed out again stays apart.
func TestHeldMergeOnFree(t *testing.T) {
	h := newHeldHarness(t)
	// One 20 MiB large segment cut in three: x, y, rest.
	x := h.malloc(4*MiB, 0)
	y := h.malloc(4*MiB, 0)
	z := h.malloc(12*MiB, 0)
	require.Equal(t, x.Seg, z.Seg)
	xPtr := x.Ptr
	h.hold(x)
	require.False(t, h.c.FreeNeighbour(x), "its neighbour y is allocated")
	h.freeBlock(y)
	require.Empty(t, h.front, "x claimed back")
	require.Nil(t, h.c.Lookup(xPtr), "x is no longer allocated")
	st := h.c.ReadStats()
	require.EqualValues(t, 1, st.InactiveSplit[0].Current, "x and y merged into one free split block")
	require.EqualValues(t, 8*MiB, st.InactiveSplitBytes[0].Current)
	m := h.malloc(8*MiB, 0)
	require.Equal(t, xPtr, m.Ptr, "the merged block serves 8 MiB")

	// Served meanwhile: no merge.
	h.hold(z)
	delete(h.front, z)
	h.freeBlock(m)
	require.True(t, z.Allocated, "z is in use again: not merged")
	require.True(t, h.c.FreeNeighbour(z), "its free neighbour is left apart")
	h.c.CountFrontReuse(z)
	require.NoError(t, h.c.Check())
}

// The index stays sorted by (stream, size, address) through inserts and
// removes, and Check verifies it against the blocks.
func TestHeldIndexOrder(t *testing.T) {
	h := newHeldHarness(t)
	var bs []*Block
	for _, sz := range []uint64{30, 20, 40, 20, 50} {
		bs = append(bs, h.malloc(sz*MiB, 0))
	}
	for _, b := range bs {
		h.hold(b)
	}
	idx := bs[0].Pool.held.s
	require.Len(t, idx, 5)
	for i := 1; i < len(idx); i++ {
		require.True(t, keyOf(idx[i-1]).less(keyOf(idx[i])))
	}
	require.Equal(t, idx[0], bs[1].Pool.held.lowerBound(key{0, 20 * MiB, 0}))
	h.c.CountFrontReuse(bs[1])
	require.NoError(t, h.c.Check())
	idx[0].inHeld = false // corrupt: Check notices
	require.Error(t, h.c.Check())
	idx[0].inHeld = true
	require.NoError(t, h.c.Check())
}
