package pools

import (
	"fmt"
	"sort"
)

// Blocks held in a front cache.
//
// A front cache (allocator/front.go) may keep a freed block for its next
// malloc of the same size: the block stays allocated here (Block.Held)
// while the statistics count it free. Held blocks must not change where
// best fit puts anything else, or over many steps of varying sizes the
// segments fragment (a GPT-2 training run of 75 steps: 6.27 GiB reserved
// against 6.16 without the front; docs/hot-path.md, section 20). Three
// rules keep the structures as they would be without the front, except for
// the blocks the front hands out itself:
//
//   - a block is not held next to a free or held block it would merge with
//     (the owner's check, FreeNeighbour);
//   - a block freed next to a held one claims it back and merges with it
//     (mergeFreeing);
//   - best fit sees the held blocks: a held block that fits better than
//     every free one is claimed back and taken (TakeFree).
//
// Claiming goes through Cache.Claim, since the front may have handed the
// block out again meanwhile. The held blocks of a pool are indexed here in
// the free sets' (stream, size, address) order: a sorted slice, as a front
// holds few (64 per device).

// heldIndex is a pool's held blocks, sorted by (stream, size, address).
type heldIndex struct {
	s []*Block
}

// heldCap is the capacity a pool's index starts with: the C front's limit,
// so that holding allocates once per pool.
const heldCap = 64

func (h *heldIndex) search(k key) int {
	return sort.Search(len(h.s), func(i int) bool { return !keyOf(h.s[i]).less(k) })
}

func (h *heldIndex) insert(b *Block) {
	if h.s == nil {
		h.s = make([]*Block, 0, heldCap)
	}
	i := h.search(keyOf(b))
	h.s = append(h.s, nil)
	copy(h.s[i+1:], h.s[i:])
	h.s[i] = b
	b.inHeld = true
}

func (h *heldIndex) remove(b *Block) {
	if !b.inHeld {
		return
	}
	b.inHeld = false
	i := h.search(keyOf(b))
	for ; i < len(h.s) && h.s[i] != b; i++ {
	}
	if i == len(h.s) {
		panic("pools: a held block missing from its index")
	}
	copy(h.s[i:], h.s[i+1:])
	h.s[len(h.s)-1] = nil
	h.s = h.s[:len(h.s)-1]
}

// lowerBound is the first held block at or after (s, size, 0), or nil.
func (h *heldIndex) lowerBound(k key) *Block {
	if i := h.search(k); i < len(h.s) {
		return h.s[i]
	}
	return nil
}

// Held is the number of the pool's blocks held in front (indexed).
func (p *BlockPool) Held() int { return len(p.held.s) }

// claimBetterHeld frees for real, through Claim, the held block that best
// fit would pick for r over every free block of r's pool, so that TakeFree
// finds it: best fit over free and held blocks alike.
//
//go:noinline
func (c *Cache) claimBetterHeld(r *Request) {
	p := r.Pool
	k := key{r.Stream, r.Size, 0}
	for {
		h := p.held.lowerBound(k)
		if h == nil || h.Stream != r.Stream {
			return
		}
		if b := p.Blocks.LowerBound(r.Stream, r.Size); b != nil && b.Stream == r.Stream && keyOf(b).less(keyOf(h)) {
			return
		}
		if c.claimHeld(h) {
			return
		}
		// Handed out again by the front: no longer a candidate.
		p.held.remove(h)
	}
}

// check verifies the index of pool p, whose segments hold n indexed blocks:
// it holds those n, sorted, each held and of p.
func (h *heldIndex) check(p *BlockPool, n int) error {
	if len(h.s) != n {
		return fmt.Errorf("pool %v small=%v: held index has %d blocks, segments %d", p.ID, p.Small, len(h.s), n)
	}
	for i, b := range h.s {
		if !b.inHeld || !b.Held || b.Pool != p {
			return fmt.Errorf("pool %v small=%v: held index entry %#x: inHeld=%v held=%v", p.ID, p.Small, b.Ptr, b.inHeld, b.Held)
		}
		if i > 0 && !keyOf(h.s[i-1]).less(keyOf(b)) {
			return fmt.Errorf("pool %v small=%v: held index out of order at %#x", p.ID, p.Small, b.Ptr)
		}
	}
	return nil
}
