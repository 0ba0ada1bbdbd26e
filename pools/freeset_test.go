// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"math/rand"
	"sort"
	"testing"

	"github.com/cudapool/cudapool/cuda"
	"github.com/stretchr/testify/require"
)

// One suite, run against both FreeSet implementations (as bbolt does for its
// freelists), each checked against a brute-force model.
func forEachFreeSet(t *testing.T, fn func(t *testing.T, k FreeSetKind)) {
	for _, k := range FreeSetKinds {
		t.Run(k.String(), func(t *testing.T) { fn(t, k) })
	}
}

func sortedModel(bs map[*Block]bool) []*Block {
	var out []*Block
	for b := range bs {
		out = append(out, b)
	}
	sort.Slice(out, func(i, j int) bool { return keyOf(out[i]).less(keyOf(out[j])) })
	return out
}

func TestFreeSetOrderAndBounds(t *testing.T) {
	forEachFreeSet(t, func(t *testing.T, k FreeSetKind) {
		s := NewFreeSet(k)
		mk := func(st cuda.Stream, size uint64, p cuda.Ptr) *Block {
			b := &Block{Stream: st, Size: size, Ptr: p}
			s.Insert(b)
			return b
		}
		a := mk(1, 4096, 0x3000)
		b := mk(1, 4096, 0x1000)
		c := mk(1, 8192, 0x2000)
		d := mk(2, 512, 0x9000)
		require.Equal(t, 4, s.Len())
		var order []*Block
		s.Ascend(func(x *Block) bool { order = append(order, x); return true })
		require.Equal(t, []*Block{b, a, c, d}, order, "ordered by stream, size, address")

		require.Same(t, b, s.LowerBound(1, 4096), "best fit, lowest address among equals")
		require.Same(t, b, s.LowerBound(1, 1000))
		require.Same(t, c, s.LowerBound(1, 4097))
		require.Same(t, d, s.LowerBound(1, 8193), "next stream's block; caller checks the stream")
		require.Nil(t, s.LowerBound(2, 513))
		require.Same(t, a, s.Before(1, 8192, 0))
		require.Same(t, b, s.Before(a.Stream, a.Size, a.Ptr))
		require.Nil(t, s.Before(1, 4096, 0x1000))
		require.Same(t, a, s.After(b))
		require.Same(t, c, s.After(a))
		require.Same(t, d, s.After(c))
		require.Nil(t, s.After(d))

		s.Remove(b)
		require.False(t, b.inSet)
		require.Same(t, a, s.LowerBound(1, 4096))
		require.Panics(t, func() { s.Remove(b) }, "removing twice is a bug")
		require.Panics(t, func() { s.Insert(a) }, "inserting twice is a bug")
	})
}

func TestFreeSetRandomAgainstModel(t *testing.T) {
	forEachFreeSet(t, func(t *testing.T, k FreeSetKind) {
		rng := rand.New(rand.NewSource(7))
		s := NewFreeSet(k)
		model := map[*Block]bool{}
		var next cuda.Ptr = 0x100000
		for step := 0; step < 5000; step++ {
			if rng.Intn(3) > 0 || len(model) == 0 {
				b := &Block{Stream: cuda.Stream(rng.Intn(3)), Size: uint64(rng.Intn(20)+1) * 512, Ptr: next}
				next += 0x10000
				s.Insert(b)
				model[b] = true
			} else {
				for b := range model {
					s.Remove(b)
					delete(model, b)
					break
				}
			}
			st, size := cuda.Stream(rng.Intn(3)), uint64(rng.Intn(22))*512
			want := sortedModel(model)
			var lb, before *Block
			for _, b := range want {
				if !keyOf(b).less(key{st, size, 0}) {
					lb = b
					break
				}
				before = b
			}
			require.Same(t, lb, s.LowerBound(st, size), "step %d", step)
			require.Same(t, before, s.Before(st, size, 0), "step %d", step)
			require.Equal(t, len(model), s.Len())
		}
		var got []*Block
		s.Ascend(func(b *Block) bool { got = append(got, b); return true })
		require.Equal(t, sortedModel(model), got)
		for i, b := range got {
			var want *Block
			if i+1 < len(got) {
				want = got[i+1]
			}
			require.Same(t, want, s.After(b))
		}
	})
}

func TestFreeSetAscendStops(t *testing.T) {
	forEachFreeSet(t, func(t *testing.T, k FreeSetKind) {
		s := NewFreeSet(k)
		for i := 0; i < 10; i++ {
			s.Insert(&Block{Size: 512, Ptr: cuda.Ptr(i+1) * 4096})
		}
		n := 0
		s.Ascend(func(*Block) bool { n++; return n < 3 })
		require.Equal(t, 3, n)
	})
}

func TestPtrMap(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	m := NewPtrMapForTest(4)
	model := map[uintptr]*Block{}
	for i := 0; i < 20000; i++ {
		// Aligned addresses in a narrow range collide a lot: backward-shift
		// deletion must keep every probe run intact.
		p := uintptr(rng.Intn(3000)+1) * 512
		if rng.Intn(2) == 0 {
			b := &Block{}
			m.Put(p, b)
			model[p] = b
		} else {
			_, had := model[p]
			require.Equal(t, had, m.Del(p))
			delete(model, p)
		}
		if i%97 == 0 {
			for k, v := range model {
				require.Same(t, v, m.Get(k))
			}
		}
		require.Equal(t, len(model), m.Len())
	}
	for k := range model {
		require.True(t, m.Del(k))
	}
	require.Equal(t, 0, m.Len())
	require.Nil(t, m.Get(512))
}

func TestPtrMapSteadyStateDoesNotGrow(t *testing.T) {
	m := NewPtrMapForTest(64)
	for i := uintptr(1); i <= 64; i++ {
		m.Put(i*512, &Block{})
	}
	c := m.Cap()
	for round := 0; round < 1000; round++ {
		p := uintptr(round%64+1) * 512
		require.True(t, m.Del(p))
		m.Put(p, &Block{})
	}
	require.Equal(t, c, m.Cap(), "no tombstones, no rehash")
}

// Sizes over the whole range (every size class, the edges of the classes,
// 2^64-1) and streams that come and go, against the brute-force model: the
// bins of the segregated fit must partition the order exactly.
func TestFreeSetWideSizesAgainstModel(t *testing.T) {
	forEachFreeSet(t, func(t *testing.T, k FreeSetKind) {
		rng := rand.New(rand.NewSource(11))
		size := func() uint64 {
			switch rng.Intn(4) {
			case 0: // around a class edge
				e := uint(rng.Intn(60) + 4)
				return uint64(1)<<e + uint64(rng.Intn(3)) - 1
			case 1:
				return ^uint64(0) - uint64(rng.Intn(2))
			default:
				return uint64(rng.Int63n(1<<uint(rng.Intn(40)+1))) + 1
			}
		}
		s := NewFreeSet(k)
		model := map[*Block]bool{}
		var next cuda.Ptr = 0x100000
		peak := 0 // the most streams holding blocks at once
		for step := 0; step < 4000; step++ {
			// Streams drift from 0-3 to 6-9 so that sets empty and are reused.
			st := cuda.Stream(rng.Intn(4) + step*6/4000)
			if rng.Intn(5) < 3 || len(model) == 0 {
				b := &Block{Stream: st, Size: size(), Ptr: next}
				next += 0x200
				s.Insert(b)
				model[b] = true
				streams := map[cuda.Stream]bool{}
				for b := range model {
					streams[b.Stream] = true
				}
				peak = max(peak, len(streams))
			} else {
				for b := range model {
					s.Remove(b)
					delete(model, b)
					break
				}
			}
			want := sortedModel(model)
			qs, qsize, qptr := cuda.Stream(rng.Intn(12)), size(), cuda.Ptr(rng.Int63n(int64(next)))
			var lb, before *Block
			for _, b := range want {
				if lb == nil && !keyOf(b).less(key{qs, qsize, 0}) {
					lb = b
				}
				if keyOf(b).less(key{qs, qsize, qptr}) {
					before = b
				}
			}
			require.Same(t, lb, s.LowerBound(qs, qsize), "step %d", step)
			require.Same(t, before, s.Before(qs, qsize, qptr), "step %d", step)
			if len(want) > 0 {
				i := rng.Intn(len(want))
				var after *Block
				if i+1 < len(want) {
					after = want[i+1]
				}
				require.Same(t, after, s.After(want[i]), "step %d", step)
			}
			if step%200 == 0 {
				var got []*Block
				s.Ascend(func(b *Block) bool { got = append(got, b); return true })
				require.Equal(t, want, got, "step %d", step)
			}
		}
		if sf, ok := s.(*segfit); ok {
			// Emptied streams' bins were reused, not piled up: no more
			// sets than streams ever held blocks at once (10 were used).
			require.LessOrEqual(t, len(sf.sets), peak)
			require.Less(t, peak, 10)
		}
	})
}

func TestSizeClassMonotone(t *testing.T) {
	prev := -1
	check := func(size uint64) {
		c := sizeClass(size)
		require.GreaterOrEqual(t, c, prev, "size %d", size)
		require.Less(t, c, sfClasses, "size %d", size)
		prev = c
	}
	for s := uint64(0); s < 1<<16; s++ {
		check(s)
	}
	for e := uint(16); e < 64; e++ {
		for _, d := range []uint64{0, 1, 1 << (e - 5), 1<<(e-4) - 1, 1 << (e - 4), 1<<e - 1} {
			check(uint64(1)<<e + d)
		}
	}
	check(^uint64(0))
	require.Equal(t, sfClasses-1, sizeClass(^uint64(0)), "the last class is used")
	// The small pool's sizes below 16 KiB (512-byte multiples) have a class
	// each: a bin there holds one size, ordered by address.
	seen := map[int]bool{}
	for s := uint64(512); s < 16<<10; s += 512 {
		require.False(t, seen[sizeClass(s)], "size %d shares a class", s)
		seen[sizeClass(s)] = true
	}
}

// The segregated fit allocates nothing once a stream's bins exist, even when
// the set empties and refills (every cache-hit pair on a lone segment).
func TestSegFitSteadyStateAllocatesNothing(t *testing.T) {
	s := NewFreeSet(FreeSetSegFit)
	a, b := &Block{Stream: 3, Size: 4096, Ptr: 0x1000}, &Block{Stream: 3, Size: 2 << 20, Ptr: 0x2000}
	s.Insert(a)
	s.Remove(a)
	n := testing.AllocsPerRun(1000, func() {
		s.Insert(a)
		s.Insert(b)
		if s.LowerBound(3, 8192) != b || s.After(a) != b {
			panic("wrong block")
		}
		s.Remove(a)
		s.Remove(b)
	})
	require.Zero(t, n)
}
