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
	for _, k := range []FreeSetKind{FreeSetTreap, FreeSetSorted} {
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
