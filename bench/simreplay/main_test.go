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
