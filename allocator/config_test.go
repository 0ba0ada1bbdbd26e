// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
)

// A value every key the parser lists accepts.
var validValues = map[string]string{
	"backend": "native", "expandable_segments": "True", "expandable_segments_reserve": "0.5",
	"expandable_segments_reserve_by_class": "[decode:4G,prefill:0.5]", "garbage_collection_threshold": "0.5",
	"graph_capture_record_stream_reuse": "True", "large_segment_size_mb": "40", "max_non_split_rounding_mb": "40",
	"max_split_size_mb": "64", "per_process_memory_fraction": "0.5", "pinned_free_catch_all": "True",
	"pinned_num_register_threads": "8", "pinned_reserve_segment_size_mb": "64", "pinned_use_background_threads": "True",
	"pinned_use_cuda_host_register": "True", "pinned_use_hip_host_register": "False", "release_lock_on_cudamalloc": "False",
	"release_lock_on_hipmalloc": "False", "roundup_power2_divisions": "[64:8,>:1]", "throw_on_cudamalloc_oom": "False",
	"debug_checks": "False", "expandable_map_unit_mb": "2", "free_set": "treap", "front_cache": "True",
	"record_history": "10", "stitch": "False", "stitch_chunk_mb": "4", "stitch_sync": "False", "warm_runtime": "True",
}

// knownKeys reads the key lists from the error of an unknown key.
func knownKeys(t *testing.T, msg string) []string {
	t.Helper()
	_, lists, ok := strings.Cut(msg, "the known keys are PyTorch's ")
	require.True(t, ok, msg)
	pt, own, ok := strings.Cut(lists, " and cudapool's own ")
	require.True(t, ok, msg)
	return append(strings.Split(pt, ", "), strings.Split(own, ", ")...)
}

// A key unknown to both cudapool and PyTorch is an error naming it and the
// known keys; keys are case-sensitive, as in PyTorch, with a hint when only
// the case is wrong.
func TestConfigUnknownKey(t *testing.T) {
	_, _, err := allocator.ParseConfig("max_split_size_mb:64,Expandable_Segments:True")
	require.ErrorIs(t, err, allocator.ErrInvalidConfig)
	msg := err.Error()
	require.Contains(t, msg, `unknown key "Expandable_Segments"`)
	require.Contains(t, msg, `keys are case-sensitive: did you mean "expandable_segments"?`)
	keys := knownKeys(t, msg)
	require.Contains(t, keys, "expandable_segments")
	require.Contains(t, keys, "pinned_use_background_threads")
	require.Contains(t, keys, "record_history")

	_, _, err = allocator.ParseConfig("foo:bar")
	require.ErrorIs(t, err, allocator.ErrInvalidConfig)
	require.Contains(t, err.Error(), `unknown key "foo";`)
	require.NotContains(t, err.Error(), "did you mean")

	// Every listed key is accepted, and the list is the one the parser knows.
	require.Len(t, keys, len(validValues))
	for _, k := range keys {
		v, ok := validValues[k]
		require.True(t, ok, "no test value for the listed key %q", k)
		_, _, err := allocator.ParseConfig(k + ":" + v)
		require.NoError(t, err, k)
	}
}

// PyTorch's keys that cudapool does not use are accepted and change
// nothing; those a user might expect to act are noted; their values are
// still checked where PyTorch's are plain booleans and numbers.
func TestConfigPyTorchKeysIgnored(t *testing.T) {
	cfg, warn, err := allocator.ParseConfig("pinned_use_cuda_host_register:True,pinned_use_hip_host_register:False," +
		"pinned_num_register_threads:8,pinned_use_background_threads:True,pinned_reserve_segment_size_mb:64," +
		"pinned_free_catch_all:True,throw_on_cudamalloc_oom:False")
	require.NoError(t, err)
	require.Empty(t, warn)
	require.Equal(t, allocator.DefaultConfig(), cfg)

	_, warn, err = allocator.ParseConfig("throw_on_cudamalloc_oom:True,expandable_segments_reserve:0.5,expandable_segments_reserve_by_class:[a:1G,b:0.5]")
	require.NoError(t, err)
	require.Len(t, warn, 3)
	for _, w := range warn {
		require.Contains(t, w, "has no effect in cudapool")
	}

	cfg, warn, err = allocator.ParseConfig("release_lock_on_hipmalloc:True")
	require.NoError(t, err, "the ROCm spelling, which PyTorch's CUDA builds accept")
	require.True(t, cfg.ReleaseLockOnMalloc)
	require.Len(t, warn, 1)

	for _, bad := range []string{"pinned_use_cuda_host_register:maybe", "pinned_num_register_threads:-1", "throw_on_cudamalloc_oom:2"} {
		_, _, err := allocator.ParseConfig(bad)
		require.ErrorIs(t, err, allocator.ErrInvalidConfig, bad)
	}
}

// A long bad input is quoted cut to its first 200 bytes (whole characters)
// and its length, once.
func TestConfigErrorQuotesLongInputCut(t *testing.T) {
	for _, c := range []struct{ conf, want string }{
		{"max_split_size_mb:x" + strings.Repeat("y", 120_000), "max_split_size_mb=xyyy"},
		{strings.Repeat("zz", 60_000) + ":1", `unknown key "zzzz`},
		{strings.Repeat("n", 120_000), `"nnnn`},
		{"free_set:" + strings.Repeat("a", 199) + strings.Repeat("é", 1000), "free_set=aaa"},
	} {
		_, _, err := allocator.ParseConfig(c.conf)
		require.ErrorIs(t, err, allocator.ErrInvalidConfig)
		msg := err.Error()
		require.Contains(t, msg, c.want)
		require.Less(t, len(msg), 1500, "the message is short: %.300s", msg)
		require.Contains(t, msg, " bytes)")
		require.Equal(t, 1, strings.Count(msg, "... ("), "cut once: %.300s", msg)
		require.True(t, utf8.ValidString(msg), "cut between characters")
	}
	// Short input is quoted whole.
	_, _, err := allocator.ParseConfig("max_split_size_mb:abc")
	require.EqualError(t, err, "cudapool: configure: max_split_size_mb=abc: expected a non-negative integer")
}

// A run-time update with an unknown key changes nothing.
func TestConfigUpdateUnknownKey(t *testing.T) {
	base, _, err := allocator.ParseConfig("max_split_size_mb:64")
	require.NoError(t, err)
	got, _, err := allocator.ParseConfigUpdate(base, "garbage_collection_threshold:0.5,EXPANDABLE_SEGMENTS:True")
	require.ErrorIs(t, err, allocator.ErrInvalidConfig)
	require.Contains(t, err.Error(), `did you mean "expandable_segments"?`)
	require.Equal(t, base, got)
}
