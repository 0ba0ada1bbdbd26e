// SPDX-License-Identifier: Apache-2.0

package sim_test

import (
	"bytes"
	"errors"
	"math/rand"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

// Contents need no switch: copies of memory nothing wrote move zeros (and
// count), a write is read back at once, and only accessible memory of the
// device is a kernel's to write.
func TestContentsAlwaysOn(t *testing.T) {
	d := sim.New(sim.Options{})
	p, err := d.MemAlloc(0, mib)
	require.NoError(t, err)
	h, err := d.HostAlloc(0, mib)
	require.NoError(t, err)
	require.NoError(t, d.WriteHost(h, []byte{5, 5}))
	require.NoError(t, d.MemcpyDtoHAsync(0, h, p, mib, 1))
	d.Complete(1)
	n, b := d.Copies()
	assert.Equal(t, int64(1), n)
	assert.Equal(t, mib, b)
	got, err := d.ReadHost(h, mib)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, mib), got, "the copy wrote the device's zeros over the host's bytes")

	require.NoError(t, d.WriteDevice(0, p+7, []byte{1, 2}))
	got, err = d.ReadDevice(0, p+6, 4)
	require.NoError(t, err)
	assert.Equal(t, []byte{0, 1, 2, 0}, got)
	got, err = d.ReadDevice(0, p, 0)
	require.NoError(t, err)
	assert.Empty(t, got)

	// Mapped without access: PhysicalAt names it, a kernel may not touch it.
	r, err := d.MemAddressReserve(0, gran)
	require.NoError(t, err)
	mh, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	require.NoError(t, d.MemMap(0, r, gran, mh))
	_, _, ok := d.PhysicalAt(0, r)
	assert.True(t, ok)
	assert.ErrorIs(t, d.WriteDevice(0, r, []byte{1}), cuda.ErrInvalidValue)
	_, err = d.ReadDevice(0, r, 1)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue)
	require.NoError(t, d.MemSetAccess(0, r, gran))
	got, err = d.ReadDevice(0, r, 1)
	require.NoError(t, err)
	assert.Equal(t, []byte{0}, got, "the refused write wrote nothing")

	assert.ErrorIs(t, d.WriteDevice(1, p, []byte{1}), cuda.ErrInvalidDevice)
	assert.ErrorIs(t, d.WriteHost(h+cuda.HostPtr(mib), []byte{1}), cuda.ErrInvalidValue, "past the pinned allocation")
}

// Contents follow physical memory: a copy to the host keeps them through an
// unmap and release, memory newly mapped at the same address reads as
// zeros, and the copy back restores them; copies move bytes when their
// stream completes them.
func TestContentsFollowPhysicalMemory(t *testing.T) {
	d := sim.New(sim.Options{})
	rng := rand.New(rand.NewSource(1))
	const size = 3 * gran
	base, hs := mapRange(t, d, 0, size)
	data := randomBytes(rng, int(size))
	require.NoError(t, d.WriteDevice(0, base, data))
	got, err := d.ReadDevice(0, base+100, 1000)
	require.NoError(t, err)
	assert.Equal(t, data[100:1100], got)

	host, err := d.HostAlloc(0, size+4096)
	require.NoError(t, err)
	s, err := d.StreamCreate(0)
	require.NoError(t, err)
	// Two copies, crossing granules (physical allocations).
	require.NoError(t, d.MemcpyDtoHAsync(0, host+4096, base, gran+17, s))
	require.NoError(t, d.MemcpyDtoHAsync(0, host+4096+cuda.HostPtr(gran+17), base+cuda.Ptr(gran+17), size-gran-17, s))
	got, err = d.ReadHost(host+4096, 64)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, 64), got, "not yet copied: the stream has not run")
	require.NoError(t, d.StreamSynchronize(0, s))
	got, err = d.ReadHost(host+4096, size)
	require.NoError(t, err)
	require.True(t, bytes.Equal(data, got), "host copy differs")

	// Pause: unmap and release; resume: new memory at the same addresses.
	require.NoError(t, d.MemUnmap(0, base, size))
	for _, h := range hs {
		require.NoError(t, d.MemRelease(0, h))
	}
	for off := uint64(0); off < size; off += gran {
		h, err := d.MemCreate(0, gran)
		require.NoError(t, err)
		require.NoError(t, d.MemMap(0, base+cuda.Ptr(off), gran, h))
	}
	require.NoError(t, d.MemSetAccess(0, base, size))
	got, err = d.ReadDevice(0, base, size)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, size), got, "new physical memory holds none of the old bytes")

	require.NoError(t, d.MemcpyHtoDAsync(0, base, host+4096, size, s))
	d.Complete(s)
	got, err = d.ReadDevice(0, base, size)
	require.NoError(t, err)
	require.True(t, bytes.Equal(data, got), "device contents differ after the copy back")

	// A copy reads its source when it runs, not when it is queued.
	require.NoError(t, d.MemcpyDtoHAsync(0, host, base, 4, s))
	require.NoError(t, d.WriteDevice(0, base, []byte{9, 9, 9, 9}))
	d.CompleteAll()
	got, err = d.ReadHost(host, 4)
	require.NoError(t, err)
	assert.Equal(t, []byte{9, 9, 9, 9}, got)
}

// A handle mapped at two addresses shows the same bytes at both; memory
// from MemAlloc holds contents too.
func TestContentsAliasAndMemAlloc(t *testing.T) {
	d := sim.New(sim.Options{})
	r, err := d.MemAddressReserve(0, 2*gran)
	require.NoError(t, err)
	h, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	require.NoError(t, d.MemMap(0, r, gran, h))
	require.NoError(t, d.MemMap(0, r+cuda.Ptr(gran), gran, h))
	require.NoError(t, d.MemSetAccess(0, r, 2*gran))
	require.NoError(t, d.WriteDevice(0, r+5, []byte("alias")))
	got, err := d.ReadDevice(0, r+cuda.Ptr(gran)+5, 5)
	require.NoError(t, err)
	assert.Equal(t, "alias", string(got))

	p, err := d.MemAlloc(0, 3*mib)
	require.NoError(t, err)
	require.NoError(t, d.WriteDevice(0, p+3*cuda.Ptr(mib)-2, []byte{7, 8}))
	require.ErrorIs(t, d.WriteDevice(0, p+3*cuda.Ptr(mib)-1, []byte{7, 8}), cuda.ErrInvalidValue, "past the allocation")
	host, err := d.HostAlloc(0, 2)
	require.NoError(t, err)
	require.NoError(t, d.MemcpyDtoHAsync(0, host, p+3*cuda.Ptr(mib)-2, 2, 3))
	require.NoError(t, d.MemFree(0, p))
	d.Complete(3)
	got, err = d.ReadHost(host, 2)
	require.NoError(t, err)
	assert.Equal(t, []byte{7, 8}, got, "the copy completed before the free took the memory")
}

// Huge ranges cost only the pages that hold bytes.
func TestContentsSparse(t *testing.T) {
	d := sim.New(sim.Options{Memory: 80 * gib})
	const size = 40 * gib
	base, err := d.MemAddressReserve(0, size)
	require.NoError(t, err)
	h, err := d.MemCreate(0, size)
	require.NoError(t, err)
	require.NoError(t, d.MemMap(0, base, size, h))
	require.NoError(t, d.MemSetAccess(0, base, size))
	marks := []uint64{0, 12345, size / 2, size - 3}
	for i, off := range marks {
		require.NoError(t, d.WriteDevice(0, base+cuda.Ptr(off), []byte{byte(i + 1), 0xee, 0xff}[:min(3, size-off)]))
	}
	host, err := d.HostAlloc(0, size)
	require.NoError(t, err)
	require.NoError(t, d.MemcpyDtoHAsync(0, host, base, size, 1))
	require.NoError(t, d.StreamSynchronize(0, 1))
	for i, off := range marks {
		got, err := d.ReadHost(host+cuda.HostPtr(off), 1)
		require.NoError(t, err)
		assert.Equal(t, []byte{byte(i + 1)}, got)
	}
	got, err := d.ReadHost(host+cuda.HostPtr(size/4), 8)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, 8), got)
}

// Contents survive moving a physical page to another address, as stitching
// does: unmap, map elsewhere, read.
func TestContentsFollowThePage(t *testing.T) {
	d := sim.New(sim.Options{})
	h, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	p := mapNew(t, d, h, gran)
	require.NoError(t, d.WriteDevice(0, p+cuda.Ptr(gran)-4, []byte("page")))
	require.NoError(t, d.MemUnmap(0, p, gran))
	_, err = d.ReadDevice(0, p, 1)
	require.ErrorIs(t, err, cuda.ErrInvalidValue)
	q := mapNew(t, d, h, gran)
	got, err := d.ReadDevice(0, q+cuda.Ptr(gran)-4, 4)
	require.NoError(t, err)
	assert.Equal(t, "page", string(got))
	err = d.WriteDevice(0, q+cuda.Ptr(gran)-2, []byte("over the end"))
	assert.True(t, errors.Is(err, cuda.ErrInvalidValue) && !strings.Contains(string(got), "over"))
	got, err = d.ReadDevice(0, q+cuda.Ptr(gran)-4, 4)
	require.NoError(t, err)
	assert.Equal(t, "page", string(got), "a refused write writes nothing")
}

// A copy by one process into memory it shares with another moves the bytes
// the other reads, when the copy's stream completes; and a copy from shared
// memory reads it after its exporter has let go.
func TestContentsCopiesIntoSharedMemory(t *testing.T) {
	exp := sim.New(sim.Options{})
	imp := sim.New(sim.Options{})
	h, err := exp.MemCreateShareable(0, gran, cuda.ShareableFabric)
	require.NoError(t, err)
	p := mapNew(t, exp, h, gran)
	sh, err := exp.MemExportShareable(0, h, cuda.ShareableFabric)
	require.NoError(t, err)
	ih, err := imp.MemImportShareable(0, sh)
	require.NoError(t, err)
	q := mapNew(t, imp, ih, gran)

	host, err := imp.HostAlloc(0, 8)
	require.NoError(t, err)
	require.NoError(t, imp.WriteHost(host, []byte("imported")))
	s, err := imp.StreamCreate(0)
	require.NoError(t, err)
	require.NoError(t, imp.MemcpyHtoDAsync(0, q+cuda.Ptr(gran)-8, host, 8, s))
	got, err := exp.ReadDevice(0, p+cuda.Ptr(gran)-8, 8)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, 8), got, "the copy has not run")
	require.NoError(t, imp.StreamSynchronize(0, s))
	got, err = exp.ReadDevice(0, p+cuda.Ptr(gran)-8, 8)
	require.NoError(t, err)
	assert.Equal(t, "imported", string(got))

	require.NoError(t, exp.WriteDevice(0, p, []byte("exporter")))
	require.NoError(t, exp.MemUnmap(0, p, gran))
	require.NoError(t, exp.MemRelease(0, h))
	require.NoError(t, imp.MemcpyDtoHAsync(0, host, q, 8, s))
	require.NoError(t, imp.StreamSynchronize(0, s))
	got, err = imp.ReadHost(host, 8)
	require.NoError(t, err)
	assert.Equal(t, "exporter", string(got))
	require.NoError(t, imp.MemUnmap(0, q, gran))
	require.NoError(t, imp.MemRelease(0, ih))
	assert.Zero(t, exp.Used(0))
	assert.Zero(t, exp.Violations()+imp.Violations())
}
