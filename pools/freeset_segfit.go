// SPDX-License-Identifier: Apache-2.0

package pools

// Segregated fit: the free set as size-class bins with occupancy bitmaps,
// after TLSF, but exact.
//
// Design. Blocks are grouped by stream (a short slice sorted by stream),
// then by size class: 16 classes per power of two (TLSF's two-level index),
// so a class never mixes sizes more than 1/16 apart, and the 512-byte
// multiples of the small pool below 16 KiB each get a class of their own. A
// class is monotone in the size, so the classes partition the (size,
// address) order into consecutive ranges. Each non-empty class has its bit
// set in a 64-bit word, and each non-empty word its bit in a summary word;
// the next non-empty class after any class is two count-trailing-zeros away.
//
// TLSF hands out the first block of the first class that is certain to fit,
// which is only approximately best fit. PyTorch's order is exact (the
// smallest block >= size, then the lowest address), so each class keeps its
// blocks in a small treap ordered by (size, address), built from the same
// intrusive links as the whole-pool treap. A best-fit search is one short
// descent of the request's own class (few blocks, often one size), else the
// leftmost block of the next non-empty class: a few cache lines instead of a
// descent through every free block of the pool.
//
// A stream's bins are about 8 KiB, made when the stream first frees a block
// into the set. A stream whose blocks are all gone keeps its bins (so that a
// set that empties and refills, as on every cache-hit malloc+free of a lone
// segment, allocates nothing) until another stream needs bins: then they are
// reused, so the memory held is bounded by the most streams with free blocks
// at once.

import (
	"math/bits"

	"github.com/cudapool/cudapool/cuda"
)

const (
	sfSubBits = 4                            // log2 of the classes per power of two
	sfSub     = 1 << sfSubBits               // classes per power of two
	sfClasses = (64 - sfSubBits + 1) * sfSub // sizes 0 .. 2^64-1
	sfWords   = (sfClasses + 63) / 64        // occupancy words
	sfAll     = ^uint64(0)                   // all bits set
	_         = uint32(1<<sfWords - 1)       // compile-time check: the summary fits its word
)

// sizeClass returns size's class: sizes below 16 are their own class; above,
// the power of two and the next four bits below it. It is monotone: a
// smaller size never has a larger class.
func sizeClass(size uint64) int {
	if size < sfSub {
		return int(size)
	}
	fl := bits.Len64(size) - 1 // >= sfSubBits
	sl := int(size>>uint(fl-sfSubBits)) & (sfSub - 1)
	return (fl-sfSubBits+1)*sfSub + sl
}

// segfit is the segregated-fit FreeSet.
type segfit struct {
	sets []*sfStream // ordered by stream; sets with n == 0 are spares
	n    int
	last *sfStream // the set found last: nearly every call is for it
}

// sfStream holds one stream's free blocks.
type sfStream struct {
	s       cuda.Stream
	n       int
	summary uint32            // bit w: words[w] != 0
	words   [sfWords]uint64   // bit c%64 of word c/64: bins[c] != nil
	bins    [sfClasses]*Block // treap roots, ordered by (size, address)
}

// search returns the index of the first set whose stream is >= s. Processes
// use a handful of streams, so a scan beats a binary search.
func (x *segfit) search(s cuda.Stream) int {
	i := 0
	for i < len(x.sets) && x.sets[i].s < s {
		i++
	}
	return i
}

// setOf returns s's set, or nil.
func (x *segfit) setOf(s cuda.Stream) *sfStream {
	if t := x.last; t != nil && t.s == s {
		return t
	}
	if i := x.search(s); i < len(x.sets) && x.sets[i].s == s {
		x.last = x.sets[i]
		return x.last
	}
	return nil
}

// setFor returns s's set, making one (from a spare if there is one).
func (x *segfit) setFor(s cuda.Stream) *sfStream {
	if t := x.setOf(s); t != nil {
		return t
	}
	i := x.search(s)
	var t *sfStream
	for j, o := range x.sets {
		if o.n == 0 {
			t = o
			copy(x.sets[j:], x.sets[j+1:])
			x.sets = x.sets[:len(x.sets)-1]
			if j < i {
				i--
			}
			break
		}
	}
	if t == nil {
		t = new(sfStream)
	}
	t.s = s
	x.sets = append(x.sets, nil)
	copy(x.sets[i+1:], x.sets[i:])
	x.sets[i] = t
	x.last = t
	return t
}

func (t *sfStream) has(c int) bool { return t.words[c>>6]&(1<<(c&63)) != 0 }

func (t *sfStream) mark(c int) {
	t.words[c>>6] |= 1 << (c & 63)
	t.summary |= 1 << (c >> 6)
}

func (t *sfStream) unmark(c int) {
	w := c >> 6
	t.words[w] &^= 1 << (c & 63)
	if t.words[w] == 0 {
		t.summary &^= 1 << w
	}
}

// nextClass returns the first non-empty class >= from, or -1.
func (t *sfStream) nextClass(from int) int {
	if from >= sfClasses {
		return -1
	}
	w := from >> 6
	if m := t.words[w] & (sfAll << (from & 63)); m != 0 {
		return w<<6 + bits.TrailingZeros64(m)
	}
	if m := uint64(t.summary) & (sfAll << (w + 1)); m != 0 {
		w = bits.TrailingZeros64(m)
		return w<<6 + bits.TrailingZeros64(t.words[w])
	}
	return -1
}

// prevClass returns the last non-empty class < before, or -1.
func (t *sfStream) prevClass(before int) int {
	if before <= 0 {
		return -1
	}
	c := before - 1
	w := c >> 6
	if m := t.words[w] & (sfAll >> (63 - c&63)); m != 0 {
		return w<<6 + bits.Len64(m) - 1
	}
	if m := uint64(t.summary) & (1<<w - 1); m != 0 {
		w = bits.Len64(m) - 1
		return w<<6 + bits.Len64(t.words[w]) - 1
	}
	return -1
}

func (t *sfStream) min() *Block {
	if c := t.nextClass(0); c >= 0 {
		return leftmost(t.bins[c])
	}
	return nil
}

func (t *sfStream) max() *Block {
	if c := t.prevClass(sfClasses); c >= 0 {
		return rightmost(t.bins[c])
	}
	return nil
}

func (x *segfit) Insert(b *Block) {
	if b.inSet {
		panic("pools: block inserted into a free set twice")
	}
	t := x.last // nearly every insert is for the last set found
	if t == nil || t.s != b.Stream {
		t = x.setFor(b.Stream)
	}
	b.left, b.right, b.inSet = nil, nil, true
	b.prio = hashPtr(b.Ptr)
	c := sizeClass(b.Size)
	if root := t.bins[c]; root == nil {
		t.mark(c)
		t.bins[c] = b // insert(nil, b), with no call: most bins hold one block
	} else {
		t.bins[c] = insert(root, b)
	}
	t.n++
	x.n++
}

func (x *segfit) Remove(b *Block) {
	if !b.inSet {
		panic("pools: removing a block that is not in a free set")
	}
	t := x.setOf(b.Stream)
	if t == nil {
		panic("pools: block not found in its free set")
	}
	c := sizeClass(b.Size)
	link := &t.bins[c]
	k := keyOf(b)
	for *link != b {
		n := *link
		if n == nil {
			panic("pools: block not found in its free set")
		}
		if k.less(keyOf(n)) {
			link = &n.left
		} else {
			link = &n.right
		}
	}
	*link = join(b.left, b.right)
	if t.bins[c] == nil {
		t.unmark(c)
	}
	b.left, b.right, b.inSet = nil, nil, false
	t.n--
	x.n--
}

func (x *segfit) LowerBound(s cuda.Stream, size uint64) *Block {
	if t := x.setOf(s); t != nil {
		c := sizeClass(size)
		// The occupancy bit first: it shares a cache line with the
		// stream's header, the bin slot does not, and the request's own
		// class is often empty.
		if t.has(c) {
			if b := treeLowerBound(t.bins[c], key{s, size, 0}); b != nil {
				return b
			}
		}
		if c = t.nextClass(c + 1); c >= 0 {
			return leftmost(t.bins[c])
		}
	}
	return x.firstAfter(s)
}

// firstAfter returns the first block of the streams after s.
func (x *segfit) firstAfter(s cuda.Stream) *Block {
	i := x.search(s)
	if i < len(x.sets) && x.sets[i].s == s {
		i++
	}
	return x.firstFrom(i)
}

// firstFrom returns the first block of the sets from index i on.
func (x *segfit) firstFrom(i int) *Block {
	for ; i < len(x.sets); i++ {
		if x.sets[i].n > 0 {
			return x.sets[i].min()
		}
	}
	return nil
}

func (x *segfit) Before(s cuda.Stream, size uint64, ptr cuda.Ptr) *Block {
	i := x.search(s)
	if i < len(x.sets) && x.sets[i].s == s {
		t := x.sets[i]
		c := sizeClass(size)
		if t.has(c) {
			if b := treeBefore(t.bins[c], key{s, size, ptr}); b != nil {
				return b
			}
		}
		if c = t.prevClass(c); c >= 0 {
			return rightmost(t.bins[c])
		}
	}
	for i--; i >= 0; i-- {
		if x.sets[i].n > 0 {
			return x.sets[i].max()
		}
	}
	return nil
}

func (x *segfit) After(b *Block) *Block {
	if t := x.setOf(b.Stream); t != nil {
		c := sizeClass(b.Size)
		if n := treeAfter(t.bins[c], keyOf(b)); n != nil {
			return n
		}
		if c = t.nextClass(c + 1); c >= 0 {
			return leftmost(t.bins[c])
		}
	}
	return x.firstAfter(b.Stream)
}

func (x *segfit) Len() int { return x.n }

func (x *segfit) Ascend(fn func(*Block) bool) {
	for _, t := range x.sets {
		for c := t.nextClass(0); c >= 0; c = t.nextClass(c + 1) {
			if !ascend(t.bins[c], fn) {
				return
			}
		}
	}
}
