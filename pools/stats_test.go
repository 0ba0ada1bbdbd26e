// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// TestHotStatsMatchStatArrays drives the compact per-allocation statistics
// and Stats' own StatArrays (the reference: four values per entry, every one
// updated on every change) with the same random increases, decreases and
// resets, and requires the same numbers from ReadStats' derivation after
// every step: the sums of decreases, "all"'s sums and every peak.
func TestHotStatsMatchStatArrays(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var h hotStats
	var ref Stats
	arrays := ref.hotArrays()
	cur := [2][nHot]int64{} // the pools' current values, kept >= 0
	for step := 0; step < 20000; step++ {
		q := rng.IntN(nHot)
		small := rng.IntN(2) == 0
		i := 1
		if small {
			i = 0
		}
		switch r := rng.IntN(100); {
		case r < 1:
			h.resetPeak()
			ref.ResetPeak()
		case r < 2:
			h.resetAccumulated()
			ref.ResetAccumulated()
		case r < 50:
			n := rng.Int64N(1 << 20)
			if n == 0 {
				continue
			}
			h.increase(small, q, n)
			arrays[q].Increase(small, n)
			cur[i][q] += n
		case r < 60:
			n := rng.Int64N(1<<20) - 1<<19
			if cur[i][q]+n < 0 {
				continue
			}
			h.add(small, q, n)
			arrays[q].Add(small, n)
			cur[i][q] += n
		default:
			if cur[i][q] == 0 {
				continue
			}
			n := 1 + rng.Int64N(cur[i][q])
			h.decrease(small, q, n)
			arrays[q].Decrease(small, n)
			cur[i][q] -= n
		}
		var got Stats
		h.fill(&got)
		require.Equal(t, ref, got, "step %d", step)
	}
}

// TestReadStatsPeakIsExact allocates and frees in an order whose peak of
// "all" is reached with both pools partly allocated, a value no pool's own
// peak shows.
func TestReadStatsPeakIsExact(t *testing.T) {
	h := newHarness(t, DefaultConfig())
	s := h.malloc(512*KiB, 0) // small pool
	l := h.malloc(8*MiB, 0)   // large pool
	h.freeBlock(s)
	s2 := h.malloc(256*KiB, 0)
	st := h.c.ReadStats()
	require.Equal(t, int64(512*KiB+8*MiB), st.AllocatedBytes[StatAll].Peak)
	require.Equal(t, int64(256*KiB+8*MiB), st.AllocatedBytes[StatAll].Current)
	require.Equal(t, int64(512*KiB), st.AllocatedBytes[StatSmall].Peak)
	require.Equal(t, int64(3), st.Allocation[StatAll].Allocated)
	require.Equal(t, int64(1), st.Allocation[StatAll].Freed)
	h.freeBlock(l)
	h.freeBlock(s2)
	h.c.ResetPeak()
	st = h.c.ReadStats()
	require.Zero(t, st.AllocatedBytes[StatAll].Peak)
	require.Equal(t, int64(3), st.Active[StatAll].Freed)
}

// TestHotLayout checks the layout the cache-line counts rely on (stats.go,
// Cache): hotStats line-aligned with each pool and "all" 320 bytes, and the
// Cache fields of a cache hit in its first 120 bytes.
func TestHotLayout(t *testing.T) {
	c := NewCache(DefaultConfig())
	require.Zero(t, uintptr(unsafe.Pointer(c.hot))%64, "hotStats starts a cache line")
	require.Equal(t, uintptr(320), unsafe.Offsetof(c.hot.large), "small pool and all: five lines")
	require.Equal(t, uintptr(640-128), unsafe.Offsetof(c.hot.base), "large pool and all: five lines")
	require.LessOrEqual(t, unsafe.Offsetof(c.cfg)+unsafe.Offsetof(c.cfg.RoundupDivisions)+8, uintptr(120))
	require.LessOrEqual(t, unsafe.Offsetof(c.fractionSet)+1, uintptr(120))
}
