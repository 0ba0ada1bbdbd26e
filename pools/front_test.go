// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// The front's accounting equals a real free and reallocation of the same
// block (allocation, allocated, active and requested bytes, oversize: every
// value, peaks and sums included), and k cycles equal k free+reuse pairs.
func TestFrontAccounting(t *testing.T) {
	for _, size := range []uint64{4096, 3 * MiB, 40 * MiB} {
		cfg := DefaultConfig()
		cfg.MaxSplitSize = 32 * MiB
		real, front, cyc := newHarness(t, cfg), newHarness(t, cfg), newHarness(t, cfg)
		var blocks [3]*Block
		for i, h := range []*harness{real, front, cyc} {
			h.malloc(size, 0)
			blocks[i] = h.malloc(size, 0) // split off a segment, neighbours allocated (small)
			h.malloc(size, 0)
		}
		for i := 0; i < 5; i++ {
			real.freeBlock(blocks[0])
			r := real.c.NewRequest(size, 0, real.c.Small, real.c.Large)
			b := real.c.TakeFree(&r)
			require.Equal(t, blocks[0].Ptr, b.Ptr, "the real path must find the same block back")
			blocks[0] = real.c.Allocate(&r, b)
			front.c.CountFrontFree(blocks[1])
			front.c.CountFrontReuse(blocks[1])
		}
		cyc.c.CountFrontCycles(blocks[2], 5)
		want, got, gotCyc := real.c.ReadStats(), front.c.ReadStats(), cyc.c.ReadStats()
		for _, st := range []*Stats{&got, &gotCyc} {
			require.Equal(t, want.Allocation, st.Allocation, "size %d", size)
			require.Equal(t, want.AllocatedBytes, st.AllocatedBytes, "size %d", size)
			require.Equal(t, want.Active, st.Active, "size %d", size)
			require.Equal(t, want.ActiveBytes, st.ActiveBytes, "size %d", size)
			require.Equal(t, want.RequestedBytes, st.RequestedBytes, "size %d", size)
			require.Equal(t, want.OversizeAllocations, st.OversizeAllocations, "size %d", size)
		}
		// Split blocks (not the oversize one, a segment of its own) waited
		// as inactive split blocks, as the real frees made them.
		if blocks[0].IsSplit() {
			require.Equal(t, want.InactiveSplit, got.InactiveSplit, "size %d", size)
			require.Equal(t, want.InactiveSplitBytes, got.InactiveSplitBytes, "size %d", size)
			require.Equal(t, want.InactiveSplit, gotCyc.InactiveSplit, "size %d", size)
			require.Equal(t, want.InactiveSplitBytes, gotCyc.InactiveSplitBytes, "size %d", size)
		}
		require.NoError(t, front.c.Check())
	}
}
