// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"testing"

	"github.com/cudapool/cudapool/cuda"

	"github.com/stretchr/testify/require"
)

// Pausing chunks keeps the blocks and moves their bytes from Reserved to
// PausedBytes; resuming moves them back. Check verifies the record.
func TestPauseChunks(t *testing.T) {
	c := NewCache(DefaultConfig())
	m := newFakeMapper()
	a := expAlloc(t, c, m, 3*MiB, 0) // pages 0-1
	b := expAlloc(t, c, m, 3*MiB, 0) // page 2 too
	seg := a.Seg
	st := c.ReadStats()
	reserved, allocated := c.Reserved, st.AllocatedBytes[StatAll].Current
	require.Equal(t, uint64(3*page), reserved)

	// The driver's side (vmem) clears the handles, then records the chunks,
	// in any order.
	for _, off := range []uint64{2 * page, 0, page} {
		seg.SetPage(off/page, 0)
		c.PauseChunk(seg, off, page)
	}
	require.Equal(t, []Chunk{{0, page}, {page, page}, {2 * page, page}}, seg.Paused, "in address order")
	require.Equal(t, uint64(3*page), seg.PausedBytes)
	require.Zero(t, c.Reserved)
	st = c.ReadStats()
	require.Zero(t, st.ReservedBytes[StatAll].Current)
	require.Equal(t, allocated, st.AllocatedBytes[StatAll].Current, "the blocks stay allocated")
	require.Equal(t, uint64(3*page), seg.Mapped, "and mapped, from the blocks' view")
	require.NoError(t, c.Check())

	// Frees of paused blocks are bookkeeping only.
	expFree(t, c, b)

	// A wrong record is caught.
	seg.PausedBytes++
	require.ErrorContains(t, c.Check(), "paused chunks sum to")
	seg.PausedBytes--
	seg.SetPage(0, 99)
	require.ErrorContains(t, c.Check(), "paused page 0 has handle 99")
	seg.SetPage(0, 0)

	// Resume: the last chunk first.
	for i := 2; i >= 0; i-- {
		seg.SetPage(uint64(i), cuda.MemHandle(1000+i)) // a new chunk per page
		c.ResumeChunk(seg)
	}
	require.Nil(t, seg.Paused)
	require.Zero(t, seg.PausedBytes)
	require.Equal(t, reserved, c.Reserved)
	require.NoError(t, c.Check())
	expFree(t, c, a)
}
