// SPDX-License-Identifier: Apache-2.0

package pools

import "github.com/cudapool/cudapool/cuda"

// FreeSet is a pool's set of free blocks ordered by (stream, size, address).
// Best fit on a stream is LowerBound(stream, size): the smallest block of
// that stream that is large enough, lowest address first among equals.
//
// There are three implementations behind one test suite, after bbolt's
// freelists: segregated fit (size-class bins with occupancy bitmaps, each
// bin a small treap; freeset_segfit.go), a treap of the whole pool (O(log
// n), intrusive, allocation free), and a sorted slice (simple enough to
// trust; the reference for tests). DefaultFreeSet is the one the allocator
// uses unless configured otherwise (free_set:...).
type FreeSet interface {
	Insert(b *Block)
	Remove(b *Block)
	// LowerBound returns the first block at or after (s, size, 0), or nil.
	LowerBound(s cuda.Stream, size uint64) *Block
	// Before returns the last block strictly before (s, size, ptr), or nil.
	Before(s cuda.Stream, size uint64, ptr cuda.Ptr) *Block
	// After returns the block following b (which is in the set), or nil.
	After(b *Block) *Block
	Len() int
	// Ascend calls fn in order until it returns false. fn must not modify
	// the set.
	Ascend(fn func(*Block) bool)
}

// FreeSetKind selects a FreeSet implementation.
type FreeSetKind int

const (
	FreeSetTreap FreeSetKind = iota
	FreeSetSorted
	FreeSetSegFit
)

// DefaultFreeSet is the implementation of DefaultConfig.
const DefaultFreeSet = FreeSetSegFit

// FreeSetKinds are all the implementations, for tests and benchmarks.
var FreeSetKinds = []FreeSetKind{FreeSetTreap, FreeSetSorted, FreeSetSegFit}

func (k FreeSetKind) String() string {
	switch k {
	case FreeSetSorted:
		return "sorted"
	case FreeSetSegFit:
		return "segfit"
	}
	return "treap"
}

// NewFreeSet returns an empty set of the given kind.
func NewFreeSet(k FreeSetKind) FreeSet {
	switch k {
	case FreeSetSorted:
		return &sortedSet{}
	case FreeSetSegFit:
		return &segfit{}
	}
	return &treap{}
}

// newFreeSets returns n empty sets of the given kind, made in one
// allocation (the kinds as NewFreeSet chooses them).
func newFreeSets(k FreeSetKind, n int) []FreeSet {
	switch k {
	case FreeSetSorted:
		return setsOf[sortedSet](n)
	case FreeSetSegFit:
		return setsOf[segfit](n)
	}
	return setsOf[treap](n)
}

func setsOf[T any, PT interface {
	*T
	FreeSet
}](n int) []FreeSet {
	xs, out := make([]T, n), make([]FreeSet, n)
	for i := range xs {
		out[i] = PT(&xs[i])
	}
	return out
}

// key is a position in the (stream, size, address) order.
type key struct {
	s  cuda.Stream
	sz uint64
	p  cuda.Ptr
}

func keyOf(b *Block) key { return key{b.Stream, b.Size, b.Ptr} }

// less orders keys by (stream, size, address).
func (a key) less(b key) bool {
	if a.s != b.s {
		return a.s < b.s
	}
	if a.sz != b.sz {
		return a.sz < b.sz
	}
	return a.p < b.p
}

// treap is an intrusive treap whose priorities are a hash of the block's
// address, so the shape is deterministic for a given history.
type treap struct {
	root *Block
	n    int
}

func hashPtr(p cuda.Ptr) uint64 {
	x := uint64(p)
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

func (t *treap) Insert(b *Block) {
	if b.inSet {
		panic("pools: block inserted into a free set twice")
	}
	b.left, b.right, b.inSet = nil, nil, true
	b.prio = hashPtr(b.Ptr)
	t.root = insert(t.root, b)
	t.n++
}

// insert descends to where b's priority wins and splits only the subtree
// below that point, which is small on average.
func insert(n, b *Block) *Block {
	if n == nil {
		return b
	}
	if b.prio > n.prio {
		b.left, b.right = split(n, keyOf(b))
		return b
	}
	if keyOf(b).less(keyOf(n)) {
		n.left = insert(n.left, b)
	} else {
		n.right = insert(n.right, b)
	}
	return n
}

// split divides n into the blocks ordered before (s, sz, p) and the rest.
func split(n *Block, k key) (*Block, *Block) {
	if n == nil {
		return nil, nil
	}
	if keyOf(n).less(k) {
		l, r := split(n.right, k)
		n.right = l
		return n, r
	}
	l, r := split(n.left, k)
	n.left = r
	return l, n
}

// join is merge, inlined for the usual case of a bin's block: at most one
// child, and no call.
func join(l, r *Block) *Block {
	if l == nil {
		return r
	}
	if r == nil {
		return l
	}
	return merge(l, r)
}

func merge(l, r *Block) *Block {
	switch {
	case l == nil:
		return r
	case r == nil:
		return l
	case l.prio > r.prio:
		l.right = merge(l.right, r)
		return l
	default:
		r.left = merge(l, r.left)
		return r
	}
}

func (t *treap) Remove(b *Block) {
	if !b.inSet {
		panic("pools: removing a block that is not in a free set")
	}
	link := &t.root
	for *link != b {
		n := *link
		if n == nil {
			panic("pools: block not found in its free set")
		}
		if keyOf(b).less(keyOf(n)) {
			link = &n.left
		} else {
			link = &n.right
		}
	}
	*link = merge(b.left, b.right)
	b.left, b.right, b.inSet = nil, nil, false
	t.n--
}

func (t *treap) LowerBound(s cuda.Stream, size uint64) *Block {
	return treeLowerBound(t.root, key{s, size, 0})
}

func (t *treap) Before(s cuda.Stream, size uint64, ptr cuda.Ptr) *Block {
	return treeBefore(t.root, key{s, size, ptr})
}

func (t *treap) After(b *Block) *Block { return treeAfter(t.root, keyOf(b)) }

// treeLowerBound returns the first block of the tree at or after k.
func treeLowerBound(n *Block, k key) *Block {
	var best *Block
	for n != nil {
		if keyOf(n).less(k) {
			n = n.right
		} else {
			best, n = n, n.left
		}
	}
	return best
}

// treeBefore returns the last block of the tree strictly before k.
func treeBefore(n *Block, k key) *Block {
	var best *Block
	for n != nil {
		if keyOf(n).less(k) {
			best, n = n, n.right
		} else {
			n = n.left
		}
	}
	return best
}

// treeAfter returns the first block of the tree strictly after k.
func treeAfter(n *Block, k key) *Block {
	var best *Block
	for n != nil {
		if k.less(keyOf(n)) {
			best, n = n, n.left
		} else {
			n = n.right
		}
	}
	return best
}

func leftmost(n *Block) *Block {
	for n != nil && n.left != nil {
		n = n.left
	}
	return n
}

func rightmost(n *Block) *Block {
	for n != nil && n.right != nil {
		n = n.right
	}
	return n
}

func (t *treap) Len() int { return t.n }

func (t *treap) Ascend(fn func(*Block) bool) { ascend(t.root, fn) }

func ascend(n *Block, fn func(*Block) bool) bool {
	if n == nil {
		return true
	}
	return ascend(n.left, fn) && fn(n) && ascend(n.right, fn)
}

// sortedSet keeps the blocks in a sorted slice.
type sortedSet struct{ s []*Block }

// search returns the index of the first block at or after (s, sz, p).
func (x *sortedSet) search(s cuda.Stream, sz uint64, p cuda.Ptr) int {
	k := key{s, sz, p}
	lo, hi := 0, len(x.s)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if keyOf(x.s[m]).less(k) {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

func (x *sortedSet) Insert(b *Block) {
	if b.inSet {
		panic("pools: block inserted into a free set twice")
	}
	b.inSet = true
	i := x.search(b.Stream, b.Size, b.Ptr)
	x.s = append(x.s, nil)
	copy(x.s[i+1:], x.s[i:])
	x.s[i] = b
}

func (x *sortedSet) Remove(b *Block) {
	i := x.search(b.Stream, b.Size, b.Ptr)
	if !b.inSet || i == len(x.s) || x.s[i] != b {
		panic("pools: removing a block that is not in its free set")
	}
	b.inSet = false
	copy(x.s[i:], x.s[i+1:])
	x.s[len(x.s)-1] = nil
	x.s = x.s[:len(x.s)-1]
}

func (x *sortedSet) LowerBound(s cuda.Stream, size uint64) *Block {
	if i := x.search(s, size, 0); i < len(x.s) {
		return x.s[i]
	}
	return nil
}

func (x *sortedSet) Before(s cuda.Stream, size uint64, ptr cuda.Ptr) *Block {
	if i := x.search(s, size, ptr); i > 0 {
		return x.s[i-1]
	}
	return nil
}

func (x *sortedSet) After(b *Block) *Block {
	if i := x.search(b.Stream, b.Size, b.Ptr) + 1; i < len(x.s) {
		return x.s[i]
	}
	return nil
}

func (x *sortedSet) Len() int { return len(x.s) }

func (x *sortedSet) Ascend(fn func(*Block) bool) {
	for _, b := range x.s {
		if !fn(b) {
			return
		}
	}
}
