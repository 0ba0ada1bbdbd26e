// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/pools"
)

// Run-time updates follow PyTorch's parser: three keys return to their
// defaults first, the others stay unless named, and the memory fraction is
// not changed by an update.
func TestParseConfigUpdate(t *testing.T) {
	base, _, err := allocator.ParseConfig("max_split_size_mb:100,roundup_power2_divisions:4,garbage_collection_threshold:0.5," +
		"expandable_segments:True,large_segment_size_mb:40,per_process_memory_fraction:0.5")
	require.NoError(t, err)
	got, _, err := allocator.ParseConfigUpdate(base, "max_non_split_rounding_mb:40")
	require.NoError(t, err)
	require.Equal(t, uint64(pools.Unlimited), got.Pools.MaxSplitSize, "reset")
	require.Equal(t, pools.DefaultConfig().RoundupDivisions, got.Pools.RoundupDivisions, "reset")
	require.Zero(t, got.Pools.GCThreshold, "reset")
	require.True(t, got.ExpandableSegments, "kept")
	require.Equal(t, uint64(40<<20), got.Pools.LargeSegmentSize, "kept")
	require.Equal(t, uint64(40<<20), got.Pools.MaxNonSplitRounding, "applied")
	require.False(t, got.MemoryFractionSet, "an update never sets the fraction")

	got, _, err = allocator.ParseConfigUpdate(base, "per_process_memory_fraction:0.25")
	require.NoError(t, err, "accepted")
	require.False(t, got.MemoryFractionSet, "but not applied, as in PyTorch")

	got, _, err = allocator.ParseConfigUpdate(base, "max_split_size_mb:1")
	require.ErrorIs(t, err, allocator.ErrInvalidConfig)
	require.Equal(t, base, got, "unchanged on error")
}
