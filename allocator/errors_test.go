// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
)

// Out of memory in cudapool's words, for programs that call cudapool
// directly: what was asked, what the device and cudapool hold, hints in
// cudapool's terms; Error keeps PyTorch's message for PyTorch's entry
// points. The hint names the next step for the configuration in force.
func TestOOMText(t *testing.T) {
	a, _ := newAlloc(t, 1, 4*GiB, ordinary)
	p := mustMalloc(t, a, 0, 100*MiB, 0)
	_, err := a.Malloc(&allocator.MallocRequest{Size: 5 * GiB})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	require.Contains(t, err.Error(), "PYTORCH_CUDA_ALLOC_CONF", "PyTorch's words stay in Error")

	text, ok := a.OOMText(err, 5*GiB)
	require.True(t, ok)
	for _, want := range []string{
		"out of memory on device 0: cannot allocate 5.00 GiB (5368709120 bytes);",
		"the device has 3.90 GiB free of 4.00 GiB; in use on it: this process 100.00 MiB (cudapool's and any other).",
		"cudapool holds 100.00 MiB on it: 100.00 MiB allocated, 0 bytes reserved but unallocated",
		"cudapool_empty_cache()", "cudapool's default configuration (expandable segments with stitching: leave out expandable_segments:False from CUDAPOOL_CONF)",
		"max_split_size_mb",
	} {
		require.Contains(t, text, want)
	}
	require.NotContains(t, text, "PYTORCH_CUDA_ALLOC_CONF")
	require.NotContains(t, text, "pytorch.org")
	require.NotContains(t, text, "PyTorch")

	// A size that rounds up says which segment was asked of the driver;
	// the memory fraction is told.
	require.NoError(t, a.SetMemoryFraction(0, 0.25))
	_, err = a.Malloc(&allocator.MallocRequest{Size: 1*GiB + 1})
	require.ErrorIs(t, err, allocator.ErrOutOfMemory)
	text, ok = a.OOMText(err, 1*GiB+1)
	require.True(t, ok)
	require.Contains(t, text, "cannot allocate 1.00 GiB (1073741825 bytes, in a segment of 1075838976)")
	require.Contains(t, text, "per_process_memory_fraction 0.25 allows cudapool 1024.00 MiB")

	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p, Size: 100 * MiB}))
	err = a.Free(allocator.FreeRequest{Ptr: p, Size: 100 * MiB})
	require.Error(t, err)
	_, ok = a.OOMText(err, 0)
	require.False(t, ok, "not out of memory")

	for _, c := range []struct {
		conf, hint string
		maxSplit   bool
	}{
		{"", "With expandable segments and stitching (the default), memory still reserved but unallocated after that is in partly used pages or in private pools (CUDA graphs, MemPools)", false},
		{"expandable_segments:True", "With expandable segments and stitching (the default), memory still reserved but unallocated after that is in partly used pages or in private pools (CUDA graphs, MemPools)", false},
		{"stitch:True", "With expandable segments and stitching (the default), memory still reserved but unallocated after that is in partly used pages or in private pools (CUDA graphs, MemPools)", false},
		{"stitch:False", "stitching (cudapool's default: leave out stitch:False from CUDAPOOL_CONF) may avoid the fragmentation", false},
		{"expandable_segments:True,stitch:False", "stitching (cudapool's default: leave out stitch:False from CUDAPOOL_CONF) may avoid the fragmentation", false},
		{ordinary, "cudapool's default configuration (expandable segments with stitching: leave out expandable_segments:False from CUDAPOOL_CONF) or max_split_size_mb:N", true},
	} {
		a, _ := newAlloc(t, 1, 4*GiB, c.conf)
		_, err := a.Malloc(&allocator.MallocRequest{Size: 5 * GiB})
		require.ErrorIs(t, err, allocator.ErrOutOfMemory)
		text, ok := a.OOMText(err, 5*GiB)
		require.True(t, ok)
		require.Contains(t, text, c.hint, c.conf)
		if c.maxSplit {
			require.Contains(t, text, "max_split_size_mb", c.conf)
		} else {
			require.NotContains(t, text, "max_split_size_mb", c.conf)
		}
		require.NotContains(t, text, "PyTorch", c.conf)
	}
}
