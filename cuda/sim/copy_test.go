// SPDX-License-Identifier: Apache-2.0

package sim_test

import (
	"bytes"
	"math/rand"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

// mapRange reserves size bytes on dev and maps them with one handle per
// granule, accessible; it returns the base and the handles.
func mapRange(t *testing.T, d *sim.Driver, dev int, size uint64) (cuda.Ptr, []cuda.MemHandle) {
	t.Helper()
	base, err := d.MemAddressReserve(dev, size)
	require.NoError(t, err)
	var hs []cuda.MemHandle
	for off := uint64(0); off < size; off += gran {
		h, err := d.MemCreate(dev, gran)
		require.NoError(t, err)
		require.NoError(t, d.MemMap(dev, base+cuda.Ptr(off), gran, h))
		hs = append(hs, h)
	}
	require.NoError(t, d.MemSetAccess(dev, base, size))
	return base, hs
}

func randomBytes(rng *rand.Rand, n int) []byte {
	b := make([]byte, n)
	rng.Read(b)
	return b
}

func TestHostMemory(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2})
	_, err := d.HostAlloc(0, 0)
	require.ErrorIs(t, err, cuda.ErrInvalidValue)
	_, err = d.HostAlloc(2, mib)
	require.ErrorIs(t, err, cuda.ErrInvalidDevice)

	a, err := d.HostAlloc(0, mib)
	require.NoError(t, err)
	b, err := d.HostAlloc(1, 3*mib+1)
	require.NoError(t, err)
	assert.NotEqual(t, a, b)
	n, bytes := d.HostMemory()
	assert.Equal(t, 2, n)
	assert.Equal(t, 4*mib+1, bytes)
	assert.Equal(t, int64(2), d.HostAllocCalls())

	d.SetHostLimit(5 * mib)
	_, err = d.HostAlloc(0, mib)
	require.ErrorIs(t, err, cuda.ErrOutOfMemory, "beyond the host limit")
	d.SetHostLimit(0)

	require.ErrorIs(t, d.HostFree(0, a+1), cuda.ErrInvalidValue, "not a base")
	require.NoError(t, d.HostFree(0, a))
	require.ErrorIs(t, d.HostFree(0, a), cuda.ErrInvalidValue, "freed twice")
	require.NoError(t, d.HostFree(1, b))
	n, bytes = d.HostMemory()
	assert.Zero(t, n)
	assert.Zero(t, bytes)
	assert.Zero(t, d.Violations())
}

// Allocating pinned memory is potentially unsafe and freeing it is refused
// during any capture, as with device memory.
func TestHostMemoryDuringCapture(t *testing.T) {
	d := sim.New(sim.Options{})
	keep, err := d.HostAlloc(0, mib)
	require.NoError(t, err)
	th, other := newThread(t), newThread(t)
	th.do(func() { assert.NoError(t, d.BeginCapture(1, cuda.CaptureModeGlobal)) })
	other.do(func() {
		_, err := d.HostAlloc(0, mib)
		assert.ErrorIs(t, err, cuda.ErrCaptureUnsupported)
	})
	assert.ErrorIs(t, d.HostFree(0, keep), cuda.ErrCaptureUnsupported)
	assert.Equal(t, int64(2), d.Violations())
	th.do(func() { assert.ErrorIs(t, d.EndCapture(1), cuda.ErrCaptureInvalidated) })

	// A relaxed thread may allocate during a capture.
	d.ResetViolations()
	th.do(func() { assert.NoError(t, d.BeginCapture(1, cuda.CaptureModeGlobal)) })
	other.do(func() {
		prev, err := d.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
		assert.NoError(t, err)
		p, err := d.HostAlloc(0, mib)
		assert.NoError(t, err)
		assert.NotZero(t, p)
		_, _ = d.ExchangeCaptureMode(prev)
	})
	th.do(func() { assert.NoError(t, d.EndCapture(1)) })
	assert.Zero(t, d.Violations())
	require.NoError(t, d.HostFree(0, keep))
}

func TestCopyStreams(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2})
	s0, err := d.StreamCreate(0)
	require.NoError(t, err)
	s1, err := d.StreamCreate(1)
	require.NoError(t, err)
	assert.NotEqual(t, s0, s1)
	assert.NotZero(t, s0)
	assert.Equal(t, 2, d.CopyStreams())

	p, err := d.MemAlloc(0, mib)
	require.NoError(t, err)
	h, err := d.HostAlloc(0, mib)
	require.NoError(t, err)
	require.ErrorIs(t, d.MemcpyDtoHAsync(0, h, p, mib, s1), cuda.ErrInvalidHandle, "device 1's stream")
	require.ErrorIs(t, d.StreamSynchronize(0, s1), cuda.ErrInvalidHandle)
	require.ErrorIs(t, d.StreamDestroy(0, s1), cuda.ErrInvalidHandle)
	require.NoError(t, d.MemcpyDtoHAsync(0, h, p, mib, 7), "any other stream value is a stream")

	require.NoError(t, d.StreamDestroy(0, s0))
	require.NoError(t, d.StreamDestroy(1, s1))
	require.ErrorIs(t, d.StreamDestroy(0, s0), cuda.ErrInvalidHandle)
	assert.Zero(t, d.CopyStreams())
}

// Copies check both ranges, count as work on their stream, and keep their
// device range from being unmapped until they complete.
func TestCopyRules(t *testing.T) {
	d := sim.New(sim.Options{})
	base, _ := mapRange(t, d, 0, 2*gran)
	h, err := d.HostAlloc(0, 2*gran)
	require.NoError(t, err)
	s, err := d.StreamCreate(0)
	require.NoError(t, err)

	require.NoError(t, d.MemcpyDtoHAsync(0, h, base, 0, s), "nothing to copy")
	require.ErrorIs(t, d.MemcpyDtoHAsync(0, h+1, base, 2*gran, s), cuda.ErrInvalidValue, "host range overruns")
	require.ErrorIs(t, d.MemcpyDtoHAsync(0, h-1, base, 16, s), cuda.ErrInvalidValue, "host range before")
	require.ErrorIs(t, d.MemcpyHtoDAsync(0, base+cuda.Ptr(gran), h, 2*gran, s), cuda.ErrInvalidValue, "device range overruns")
	require.ErrorIs(t, d.MemcpyHtoDAsync(0, 0x1234, h, 16, s), cuda.ErrInvalidValue, "unknown device memory")
	n, _ := d.Copies()
	assert.Zero(t, n)

	// Mapped without access: not copyable.
	other, err := d.MemAddressReserve(0, gran)
	require.NoError(t, err)
	hh, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	require.NoError(t, d.MemMap(0, other, gran, hh))
	require.ErrorIs(t, d.MemcpyDtoHAsync(0, h, other, 16, s), cuda.ErrInvalidValue)

	require.NoError(t, d.MemcpyDtoHAsync(0, h, base+cuda.Ptr(gran), gran, s))
	n, b := d.Copies()
	assert.Equal(t, int64(1), n)
	assert.Equal(t, gran, b)
	e, err := d.EventCreate(0)
	require.NoError(t, err)
	require.NoError(t, d.EventRecord(0, e, s))
	done, err := d.EventQuery(0, e)
	require.NoError(t, err)
	assert.False(t, done, "the copy is work on its stream")

	require.ErrorIs(t, d.MemUnmap(0, base+cuda.Ptr(gran), gran), cuda.ErrInvalidValue, "a pending copy reads it")
	assert.Equal(t, int64(1), d.Violations())
	d.ResetViolations()
	require.NoError(t, d.StreamSynchronize(0, s))
	done, err = d.EventQuery(0, e)
	require.NoError(t, err)
	assert.True(t, done)
	require.NoError(t, d.MemUnmap(0, base+cuda.Ptr(gran), gran))
	assert.Zero(t, d.Violations())
}

// On a capturing stream a copy is a graph node; synchronising a capturing
// stream invalidates its capture.
func TestCopyDuringCapture(t *testing.T) {
	d := sim.New(sim.Options{})
	p, err := d.MemAlloc(0, mib)
	require.NoError(t, err)
	require.NoError(t, d.WriteDevice(0, p, []byte{1, 2, 3}))
	h, err := d.HostAlloc(0, mib)
	require.NoError(t, err)
	th := newThread(t)
	th.do(func() {
		assert.NoError(t, d.BeginCapture(9, cuda.CaptureModeRelaxed))
		assert.NoError(t, d.MemcpyDtoHAsync(0, h, p, 3, 9))
		st, _, nodes, err := d.StreamCaptureGraph(0, 9, nil)
		assert.NoError(t, err)
		assert.Equal(t, cuda.CaptureActive, st)
		assert.Len(t, nodes, 1, "the copy is a node")
		assert.ErrorIs(t, d.StreamSynchronize(0, 9), cuda.ErrCaptureUnsupported)
		assert.ErrorIs(t, d.MemcpyDtoHAsync(0, h, p, 3, 9), cuda.ErrCaptureInvalidated)
		assert.ErrorIs(t, d.EndCapture(9), cuda.ErrCaptureInvalidated)
	})
	assert.Equal(t, int64(1), d.Violations())
	n, _ := d.Copies()
	assert.Zero(t, n, "captured copies run only on replay")
	got, err := d.ReadHost(h, 3)
	require.NoError(t, err)
	assert.Equal(t, []byte{0, 0, 0}, got)
}

// Copies, writes and synchronisations from many goroutines (for -race).
func TestCopyConcurrent(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dev := g % 2
			rng := rand.New(rand.NewSource(int64(g)))
			p, err := d.MemAlloc(dev, mib)
			if !assert.NoError(t, err) {
				return
			}
			h, err := d.HostAlloc(dev, mib)
			assert.NoError(t, err)
			s, err := d.StreamCreate(dev)
			assert.NoError(t, err)
			for range 20 {
				data := randomBytes(rng, 4096)
				assert.NoError(t, d.WriteHost(h, data))
				assert.NoError(t, d.MemcpyHtoDAsync(dev, p, h, 4096, s))
				assert.NoError(t, d.MemcpyDtoHAsync(dev, h+4096, p, 4096, s))
				assert.NoError(t, d.StreamSynchronize(dev, s))
				got, err := d.ReadHost(h+4096, 4096)
				assert.NoError(t, err)
				assert.True(t, bytes.Equal(data, got))
			}
			assert.NoError(t, d.StreamDestroy(dev, s))
			assert.NoError(t, d.HostFree(dev, h))
			assert.NoError(t, d.MemFree(dev, p))
		}()
	}
	wg.Wait()
	n, _ := d.HostMemory()
	assert.Zero(t, n)
	assert.Zero(t, d.Violations())
}
