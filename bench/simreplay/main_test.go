// SPDX-License-Identifier: Apache-2.0

package main

import (
	"compress/gzip"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A gzipped trace reads as its plain text does.
func TestLoadReadsGzip(t *testing.T) {
	const trace = "# a comment\na 7 4096 0\na 9 2097152 3\nf 7\nf 9\n"
	dir := t.TempDir()
	plain := filepath.Join(dir, "t.txt")
	require.NoError(t, os.WriteFile(plain, []byte(trace), 0o644))
	zipped := filepath.Join(dir, "t.txt.gz")
	f, err := os.Create(zipped)
	require.NoError(t, err)
	z := gzip.NewWriter(f)
	_, err = z.Write([]byte(trace))
	require.NoError(t, err)
	require.NoError(t, z.Close())
	require.NoError(t, f.Close())

	want, wantSlots, err := load(plain)
	require.NoError(t, err)
	require.Len(t, want, 4)
	require.Equal(t, uint64(2097152), want[1].size)
	got, slots, err := load(zipped)
	require.NoError(t, err)
	require.Equal(t, want, got)
	require.Equal(t, wantSlots, slots)

	// A .gz file that is not gzip says so, naming it.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "bad.gz"), []byte(trace), 0o644))
	_, _, err = load(filepath.Join(dir, "bad.gz"))
	require.ErrorContains(t, err, "bad.gz")
}

// The recorded traces keep the memory stitching saves, with the defaults
// (docs/fragmentation.md, "On the simulator"): within 1% of the peak
// allocated on three GPT-2 training steps, within 2% on 75 steps of
// varying length and on FSDP2's three streams, where expandable segments
// without stitching reserve over a tenth more.
func TestRecordedTracesFragmentation(t *testing.T) {
	for _, c := range []struct {
		trace string
		conf  string
		lo    float64 // reserved / allocated, at least
		hi    float64 // and at most
	}{
		{"../../demo/trace.txt", "", 1, 1.01},
		{"../../demo/train75.txt.gz", "", 1, 1.02},
		{"../../demo/fsdp2.txt.gz", "", 1, 1.02},
		{"../../demo/fsdp2.txt.gz", "stitch:False", 1.1, 1.2},
	} {
		ops, slots, err := load(c.trace)
		require.NoError(t, err)
		r, err := replay(ops, slots, c.conf, 2, 0)
		require.NoError(t, err, "%s %q", c.trace, c.conf)
		require.Zero(t, r.failed, "%s %q", c.trace, c.conf)
		ratio := float64(r.peakRes) / float64(r.peakAlloc)
		require.GreaterOrEqual(t, ratio, c.lo, "%s %q", c.trace, c.conf)
		require.LessOrEqual(t, ratio, c.hi, "%s %q", c.trace, c.conf)
		if c.conf == "" {
			require.Positive(t, r.remaps, "%s: stitching moved pages", c.trace)
			require.Positive(t, r.laterDriverMs, "%s: the moves' mapping work is priced", c.trace)
		} else {
			require.Zero(t, r.laterDriverMs, "%s %q: no mapping work once the pools took shape", c.trace, c.conf)
		}
	}
}
