// SPDX-License-Identifier: Apache-2.0

package sim_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

const gran = uint64(sim.Granularity)

// The life of an expandable range: reserve, create, map, set access, unmap,
// release, free; physical memory counts against capacity from create to the
// later of release and unmap.
func TestVMMLifecycle(t *testing.T) {
	d := sim.New(sim.Options{Memory: 64 * mib})
	g, err := d.MemGranularity(0)
	require.NoError(t, err)
	assert.Equal(t, gran, g)

	base, err := d.MemAddressReserve(0, 32*mib)
	require.NoError(t, err)
	n, bytes := d.Reservations(0)
	assert.Equal(t, 1, n)
	assert.Equal(t, 32*mib, bytes)
	free, _, _ := d.MemGetInfo(0)
	assert.Equal(t, 64*mib, free, "a reservation uses no memory")

	h1, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	h2, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	assert.Equal(t, 2*gran, d.Used(0))
	require.NoError(t, d.MemMap(0, base, gran, h1))
	require.NoError(t, d.MemMap(0, base+cuda.Ptr(gran), gran, h2))
	assert.False(t, d.Accessible(0, base, 2*gran), "mapped but no access yet")
	require.NoError(t, d.MemSetAccess(0, base, 2*gran))
	assert.True(t, d.Accessible(0, base+100, 2*gran-200))
	assert.False(t, d.Accessible(0, base, 3*gran))
	assert.Equal(t, 2*gran, d.Mapped(0))

	accessed, unmapped := d.MappingWork(0)
	assert.Equal(t, int64(2), accessed, "one call, two mappings")
	assert.Zero(t, unmapped)

	// Releasing a mapped handle keeps its memory until the unmap.
	require.NoError(t, d.MemRelease(0, h1))
	assert.Equal(t, 2*gran, d.Used(0))
	require.NoError(t, d.MemUnmap(0, base, gran))
	assert.Equal(t, gran, d.Used(0))
	assert.Equal(t, 1, d.Handles(0))

	require.ErrorIs(t, d.MemAddressFree(0, base, 32*mib), cuda.ErrInvalidValue, "still mapped")
	require.NoError(t, d.MemUnmap(0, base+cuda.Ptr(gran), gran))
	require.NoError(t, d.MemRelease(0, h2))
	assert.Zero(t, d.Used(0))
	assert.Zero(t, d.Handles(0))
	require.NoError(t, d.MemAddressFree(0, base, 32*mib))
	n, _ = d.Reservations(0)
	assert.Zero(t, n)
	maps, unmaps := d.MapCalls(0)
	assert.Equal(t, int64(2), maps)
	assert.Equal(t, int64(2), unmaps)
	_, unmapped = d.MappingWork(0)
	assert.Equal(t, int64(2), unmapped)

	// A mapping never given access is not counted when unmapped.
	base, err = d.MemAddressReserve(0, 4*mib)
	require.NoError(t, err)
	h3, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	require.NoError(t, d.MemMap(0, base, gran, h3))
	require.NoError(t, d.MemUnmap(0, base, gran))
	accessed, unmapped = d.MappingWork(0)
	assert.Equal(t, int64(2), accessed)
	assert.Equal(t, int64(2), unmapped)
	require.NoError(t, d.MemRelease(0, h3))
	require.NoError(t, d.MemAddressFree(0, base, 4*mib))
}

func TestVMMErrors(t *testing.T) {
	d := sim.New(sim.Options{Memory: 8 * mib})
	_, err := d.MemAddressReserve(0, gran+512)
	require.ErrorIs(t, err, cuda.ErrInvalidValue, "size not a multiple of the granularity")
	_, err = d.MemCreate(0, 4096)
	require.ErrorIs(t, err, cuda.ErrInvalidValue)
	_, err = d.MemCreate(0, 16*mib)
	require.ErrorIs(t, err, cuda.ErrOutOfMemory, "beyond capacity")
	d.FailAllocs(0, 1)
	_, err = d.MemCreate(0, gran)
	require.ErrorIs(t, err, cuda.ErrOutOfMemory, "injected failure")

	base, err := d.MemAddressReserve(0, 4*gran)
	require.NoError(t, err)
	h, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	h2, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	require.ErrorIs(t, d.MemMap(0, base+cuda.Ptr(4*gran), gran, h), cuda.ErrInvalidValue, "outside the reservation")
	require.ErrorIs(t, d.MemMap(0, base+512, gran, h), cuda.ErrInvalidValue, "misaligned")
	require.ErrorIs(t, d.MemMap(0, base, 2*gran, h), cuda.ErrInvalidValue, "size is not the handle's")
	require.ErrorIs(t, d.MemMap(0, base, gran, 999), cuda.ErrInvalidHandle)
	require.NoError(t, d.MemMap(0, base, gran, h))
	require.ErrorIs(t, d.MemMap(0, base, gran, h2), cuda.ErrInvalidValue, "overlaps a mapping")
	require.ErrorIs(t, d.MemSetAccess(0, base, 2*gran), cuda.ErrInvalidValue, "part of the range unmapped")
	require.ErrorIs(t, d.MemUnmap(0, base+cuda.Ptr(gran), gran), cuda.ErrInvalidValue, "nothing mapped there")
	require.ErrorIs(t, d.MemUnmap(0, base, gran/2), cuda.ErrInvalidValue, "part of a mapping")
	require.ErrorIs(t, d.MemAddressFree(0, base, 2*gran), cuda.ErrInvalidValue, "wrong size")
	require.ErrorIs(t, d.MemRelease(0, 999), cuda.ErrInvalidHandle)
	require.NoError(t, d.MemUnmap(0, base, gran))
	require.NoError(t, d.MemRelease(0, h))
	require.NoError(t, d.MemRelease(0, h2))
	require.ErrorIs(t, d.MemRelease(0, h), cuda.ErrInvalidHandle, "released twice")
	assert.Zero(t, d.Violations())
}

// Creating, mapping and setting access follow MemAlloc's rules (legal in
// relaxed mode); unmapping, releasing and freeing a range follow MemFree's
// (refused during any capture).
func TestVMMCaptureRules(t *testing.T) {
	d := sim.New(sim.Options{Memory: gib})
	th := newThread(t)
	var base cuda.Ptr
	var h, h2 cuda.MemHandle
	var err error
	th.do(func() {
		base, err = d.MemAddressReserve(0, 8*gran)
		if err == nil {
			h, err = d.MemCreate(0, gran)
		}
		if err == nil {
			err = d.MemMap(0, base, gran, h)
		}
	})
	require.NoError(t, err)

	capturer := newThread(t)
	capturer.do(func() { err = d.BeginCapture(7, cuda.CaptureModeGlobal) })
	require.NoError(t, err)
	// Global mode: creating and mapping invalidate the capture.
	th.do(func() { _, err = d.MemCreate(0, gran) })
	require.ErrorIs(t, err, cuda.ErrCaptureUnsupported)
	assert.Equal(t, int64(1), d.Violations())
	capturer.do(func() { err = d.EndCapture(7) })
	require.ErrorIs(t, err, cuda.ErrCaptureInvalidated)
	d.ResetViolations()

	// Relaxed mode: create, map, set access and reserve are legal.
	capturer.do(func() { err = d.BeginCapture(7, cuda.CaptureModeGlobal) })
	require.NoError(t, err)
	th.do(func() {
		var prev cuda.CaptureMode
		prev, err = d.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
		if err == nil {
			h2, err = d.MemCreate(0, gran)
		}
		if err == nil {
			err = d.MemMap(0, base+cuda.Ptr(gran), gran, h2)
		}
		if err == nil {
			err = d.MemSetAccess(0, base, 2*gran)
		}
		if err == nil {
			_, err = d.MemAddressReserve(0, gran)
		}
		if _, xerr := d.ExchangeCaptureMode(prev); err == nil {
			err = xerr
		}
	})
	require.NoError(t, err)
	assert.Zero(t, d.Violations())

	// Unmap, release and address free are refused whatever the mode.
	th.do(func() {
		_, _ = d.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
		err = d.MemUnmap(0, base, gran)
	})
	require.ErrorIs(t, err, cuda.ErrCaptureUnsupported)
	require.ErrorIs(t, d.MemRelease(0, h), cuda.ErrCaptureUnsupported)
	require.ErrorIs(t, d.MemAddressFree(0, base, 8*gran), cuda.ErrCaptureUnsupported)
	assert.Equal(t, int64(3), d.Violations())
	assert.Equal(t, 2*gran, d.Mapped(0), "a refused call does nothing")
	capturer.do(func() { err = d.EndCapture(7) })
	require.ErrorIs(t, err, cuda.ErrCaptureInvalidated)

	require.NoError(t, d.MemUnmap(0, base, 2*gran), "one unmap may cover several whole mappings")
	require.NoError(t, d.MemRelease(0, h))
	require.NoError(t, d.MemRelease(0, h2))
	assert.Zero(t, d.Used(0))
}

// Unmapping memory that work still queued on a stream uses is refused and
// logged; once the stream has completed that work (or an event recorded
// after it says so), the unmap goes through. Work on a capturing stream goes
// into the graph and holds nothing.
func TestVMMUnmapPendingWork(t *testing.T) {
	d := sim.New(sim.Options{Memory: 64 * mib})
	base, err := d.MemAddressReserve(0, 8*gran)
	require.NoError(t, err)
	for i := uint64(0); i < 3; i++ {
		h, err := d.MemCreate(0, gran)
		require.NoError(t, err)
		require.NoError(t, d.MemMap(0, base+cuda.Ptr(i*gran), gran, h))
		require.NoError(t, d.MemRelease(0, h))
	}
	require.NoError(t, d.MemSetAccess(0, base, 3*gran))

	// A kernel on stream 7 touches the end of page 0 and the start of page 1.
	d.Use(0, 7, base+cuda.Ptr(gran)-100, 200)
	ev, err := d.EventCreate(0)
	require.NoError(t, err)
	require.NoError(t, d.EventRecord(0, ev, 7))

	require.NoError(t, d.MemUnmap(0, base+cuda.Ptr(2*gran), gran), "page 2 is not used")
	require.Zero(t, d.Violations())
	require.ErrorIs(t, d.MemUnmap(0, base+cuda.Ptr(gran), gran), cuda.ErrInvalidValue)
	require.Equal(t, int64(1), d.Violations())
	require.Contains(t, d.ViolationLog()[0], "pending work on stream 0x7")
	assert.Equal(t, 2*gran, d.Mapped(0), "the refused unmap changed nothing")
	d.ResetViolations()

	done, err := d.EventQuery(0, ev)
	require.NoError(t, err)
	require.False(t, done)
	d.Complete(7)
	done, err = d.EventQuery(0, ev)
	require.NoError(t, err)
	require.True(t, done, "the event covers the use")
	require.NoError(t, d.MemUnmap(0, base, 2*gran))
	require.Zero(t, d.Violations())

	// Work submitted during a capture is the graph's: nothing pending.
	h, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	require.NoError(t, d.MemMap(0, base, gran, h))
	require.NoError(t, d.MemRelease(0, h))
	require.NoError(t, d.BeginCapture(9, cuda.CaptureModeRelaxed))
	d.Use(0, 9, base, 10)
	require.NoError(t, d.EndCapture(9))
	require.NoError(t, d.MemUnmap(0, base, gran))
	require.Zero(t, d.Violations(), "%v", d.ViolationLog())
	require.NoError(t, d.EventDestroy(0, ev))
}

// A freed reservation's address space is reused, as the driver reuses it:
// first fit, split, and freed neighbours merged; reserving and freeing a
// large range many more times than the device's address range holds works.
func TestVMMReusesFreedAddressSpace(t *testing.T) {
	d := sim.New(sim.Options{Memory: 64 * mib})
	a, err := d.MemAddressReserve(0, 8*gran)
	require.NoError(t, err)
	b, err := d.MemAddressReserve(0, 8*gran)
	require.NoError(t, err)
	c, err := d.MemAddressReserve(0, 8*gran)
	require.NoError(t, err)
	require.NoError(t, d.MemAddressFree(0, b, 8*gran))
	b1, err := d.MemAddressReserve(0, 2*gran)
	require.NoError(t, err)
	assert.Equal(t, b, b1, "first fit: the freed range's start")
	b2, err := d.MemAddressReserve(0, 6*gran)
	require.NoError(t, err)
	assert.Equal(t, b+cuda.Ptr(2*gran), b2, "the rest of it")
	d3, err := d.MemAddressReserve(0, 2*gran)
	require.NoError(t, err)
	assert.Greater(t, d3, c, "nothing freed left: new address space")
	for _, r := range []struct {
		p    cuda.Ptr
		size uint64
	}{{a, 8 * gran}, {b2, 6 * gran}, {b1, 2 * gran}} {
		require.NoError(t, d.MemAddressFree(0, r.p, r.size))
	}
	big, err := d.MemAddressReserve(0, 16*gran)
	require.NoError(t, err)
	assert.Equal(t, a, big, "freed neighbours merge into one range")
	require.NoError(t, d.MemAddressFree(0, big, 16*gran))

	const huge = 1 << 40 // 1 TiB: the device's range holds 16
	for i := 0; i < 100; i++ {
		p, err := d.MemAddressReserve(0, huge)
		require.NoError(t, err, "reservation %d", i)
		require.NoError(t, d.MemAddressFree(0, p, huge))
	}
	n, _ := d.Reservations(0)
	assert.Equal(t, 2, n, "c and d3, nothing else")
}
