// SPDX-License-Identifier: Apache-2.0

package sim_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

// A handle names the whole allocation whatever address inside it is given,
// opening maps an aliasing range that uses no memory, a second open of the
// handle adds a reference to the same mapping, and the last close unmaps.
func TestIPCOpenAliasesAndCountsReferences(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2, Memory: gib})
	p, err := d.MemAlloc(0, 3*mib)
	require.NoError(t, err)
	h, err := d.IpcGetMemHandle(0, p)
	require.NoError(t, err)
	inner, err := d.IpcGetMemHandle(0, p+cuda.Ptr(mib)+5)
	require.NoError(t, err)
	assert.Equal(t, h, inner, "any address inside an allocation names the allocation")
	again, err := d.IpcGetMemHandle(0, p)
	require.NoError(t, err)
	assert.Equal(t, h, again, "exporting again gives the same handle")

	used := d.Used(1)
	q, err := d.IpcOpenMemHandle(1, h)
	require.NoError(t, err)
	require.NotZero(t, q)
	assert.Equal(t, used, d.Used(1), "a mapping uses no memory of its own")
	assert.Equal(t, 1, d.Live(0), "nor allocates")
	srcDev, src, ok := d.IpcSource(1, q+cuda.Ptr(2*mib)+7)
	require.True(t, ok)
	assert.Equal(t, 0, srcDev)
	assert.Equal(t, p+cuda.Ptr(2*mib)+7, src, "the mapping aliases the allocation")
	assert.True(t, d.Accessible(1, q, 3*mib))
	assert.False(t, d.Accessible(1, q, 3*mib+1), "no further than the allocation")
	_, _, ok = d.IpcSource(0, q)
	assert.False(t, ok, "the mapping is device 1's")

	q2, err := d.IpcOpenMemHandle(1, h)
	require.NoError(t, err)
	assert.Equal(t, q, q2, "a handle open in the context maps once")
	n, refs := d.IpcMappings(1)
	assert.Equal(t, [2]int{1, 2}, [2]int{n, refs})

	// Opening on the exporting device is a distinct mapping (the simulator
	// plays both processes).
	q0, err := d.IpcOpenMemHandle(0, h)
	require.NoError(t, err)
	assert.NotEqual(t, p, q0)
	require.NoError(t, d.IpcCloseMemHandle(0, q0))

	require.ErrorIs(t, d.IpcCloseMemHandle(1, q+512), cuda.ErrInvalidValue, "not the mapping's address")
	require.ErrorIs(t, d.IpcCloseMemHandle(0, q), cuda.ErrInvalidValue, "not device 0's mapping")
	require.NoError(t, d.IpcCloseMemHandle(1, q))
	assert.True(t, d.Accessible(1, q, mib), "one reference left")
	require.NoError(t, d.IpcCloseMemHandle(1, q))
	n, refs = d.IpcMappings(1)
	assert.Equal(t, [2]int{0, 0}, [2]int{n, refs})
	assert.False(t, d.Accessible(1, q, mib), "unmapped")
	require.ErrorIs(t, d.IpcCloseMemHandle(1, q), cuda.ErrInvalidValue, "closed already")

	// Reopening maps at a fresh address: addresses are never reused.
	q3, err := d.IpcOpenMemHandle(1, h)
	require.NoError(t, err)
	assert.NotEqual(t, q, q3)
	require.NoError(t, d.IpcCloseMemHandle(1, q3))
	require.NoError(t, d.MemFree(0, p))
	assert.Zero(t, d.Violations(), "%v", d.ViolationLog())
}

// Only live MemAlloc memory has a handle, as on the driver.
func TestIPCGetMemHandleRefusals(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2, Memory: gib})
	p, err := d.MemAlloc(0, mib)
	require.NoError(t, err)
	for name, tc := range map[string]struct {
		dev int
		p   cuda.Ptr
	}{
		"one past the end": {0, p + cuda.Ptr(mib)},
		"another device's": {1, p},
		"never allocated":  {0, 0x1234},
		"the null pointer": {0, 0},
		"in the alignment": {0, p + cuda.Ptr(mib) + 4096}, // MemAlloc pads to 2 MiB
	} {
		_, err := d.IpcGetMemHandle(tc.dev, tc.p)
		assert.ErrorIs(t, err, cuda.ErrInvalidValue, name)
	}
	_, err = d.IpcGetMemHandle(2, p)
	assert.ErrorIs(t, err, cuda.ErrInvalidDevice)

	// VMM-mapped memory (expandable segments).
	base, err := d.MemAddressReserve(0, 4*sim.Granularity)
	require.NoError(t, err)
	mh, err := d.MemCreate(0, sim.Granularity)
	require.NoError(t, err)
	require.NoError(t, d.MemMap(0, base, sim.Granularity, mh))
	require.NoError(t, d.MemSetAccess(0, base, sim.Granularity))
	_, err = d.IpcGetMemHandle(0, base)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "VMM memory has no IPC handle")

	// An IPC mapping cannot be exported again.
	h, err := d.IpcGetMemHandle(0, p)
	require.NoError(t, err)
	q, err := d.IpcOpenMemHandle(1, h)
	require.NoError(t, err)
	_, err = d.IpcGetMemHandle(1, q)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "an imported mapping")

	// Freed memory.
	require.NoError(t, d.IpcCloseMemHandle(1, q))
	require.NoError(t, d.MemFree(0, p))
	_, err = d.IpcGetMemHandle(0, p)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "freed")
}

// Stale, forged and foreign handles do not open.
func TestIPCOpenRefusals(t *testing.T) {
	d := sim.New(sim.Options{Memory: gib})
	p, err := d.MemAlloc(0, mib)
	require.NoError(t, err)
	h, err := d.IpcGetMemHandle(0, p)
	require.NoError(t, err)

	for name, mod := range map[string]func(*cuda.IpcHandle){
		"zero handle":      func(x *cuda.IpcHandle) { *x = cuda.IpcHandle{} },
		"bad magic":        func(x *cuda.IpcHandle) { x[0] ^= 1 },
		"another base":     func(x *cuda.IpcHandle) { x[33] ^= 1 },
		"another gen":      func(x *cuda.IpcHandle) { x[48]++ },
		"no such device":   func(x *cuda.IpcHandle) { x[24] = 9 },
		"trailing garbage": func(x *cuda.IpcHandle) { x[63] = 1 },
		"another instance": func(x *cuda.IpcHandle) { x[16]++ },
	} {
		x := h
		mod(&x)
		_, err := d.IpcOpenMemHandle(0, x)
		assert.ErrorIs(t, err, cuda.ErrInvalidValue, name)
	}

	other := sim.New(sim.Options{Memory: gib})
	_, err = other.IpcOpenMemHandle(0, h)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "a handle names its simulator")
	_, err = d.IpcOpenMemHandle(1, h)
	assert.ErrorIs(t, err, cuda.ErrInvalidDevice)

	require.NoError(t, d.MemFree(0, p))
	_, err = d.IpcOpenMemHandle(0, h)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "stale: the memory was freed")
	n, _ := d.IpcMappings(0)
	assert.Zero(t, n)
	assert.Zero(t, d.Violations())
}

// Freeing memory whose IPC mapping is open succeeds, as on the driver, but is
// a violation: the importer's memory is undefined from then on.
func TestIPCFreeWhileOpenIsAViolation(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2, Memory: gib})
	p, err := d.MemAlloc(0, mib)
	require.NoError(t, err)
	h, err := d.IpcGetMemHandle(0, p)
	require.NoError(t, err)
	q, err := d.IpcOpenMemHandle(1, h)
	require.NoError(t, err)

	require.NoError(t, d.MemFree(0, p))
	require.Equal(t, int64(1), d.Violations())
	assert.Contains(t, d.ViolationLog()[0], "while a CUDA IPC mapping of it is open")
	assert.Zero(t, d.Used(0), "the free happened")
	_, err = d.IpcOpenMemHandle(1, h)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "the handle is stale")
	require.NoError(t, d.IpcCloseMemHandle(1, q), "the mapping still closes")

	// Exported, opened and closed before the free: no violation.
	d.ResetViolations()
	p, err = d.MemAlloc(0, mib)
	require.NoError(t, err)
	h, err = d.IpcGetMemHandle(0, p)
	require.NoError(t, err)
	q, err = d.IpcOpenMemHandle(1, h)
	require.NoError(t, err)
	require.NoError(t, d.IpcCloseMemHandle(1, q))
	require.NoError(t, d.MemFree(0, p))
	assert.Zero(t, d.Violations(), "%v", d.ViolationLog())
}

// The IPC calls are legal during any capture, in any thread mode, and
// invalidate nothing (as measured on the driver).
func TestIPCDuringCapture(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2, Memory: gib})
	p, err := d.MemAlloc(0, mib)
	require.NoError(t, err)
	capturer := newThread(t)
	capturer.do(func() { err = d.BeginCapture(7, cuda.CaptureModeGlobal) })
	require.NoError(t, err)

	th := newThread(t) // global mode, like the capturer
	var h cuda.IpcHandle
	var q cuda.Ptr
	th.do(func() {
		h, err = d.IpcGetMemHandle(0, p)
		if err == nil {
			q, err = d.IpcOpenMemHandle(1, h)
		}
		if err == nil {
			err = d.IpcCloseMemHandle(1, q)
		}
	})
	require.NoError(t, err)
	capturer.do(func() {
		h, err = d.IpcGetMemHandle(0, p)
		if err == nil {
			q, err = d.IpcOpenMemHandle(1, h)
		}
		if err == nil {
			err = d.IpcCloseMemHandle(1, q)
		}
	})
	require.NoError(t, err)
	assert.Zero(t, d.Violations(), "%v", d.ViolationLog())
	st, _, err := d.StreamCaptureInfo(0, 7)
	require.NoError(t, err)
	assert.Equal(t, cuda.CaptureActive, st)
	capturer.do(func() { err = d.EndCapture(7) })
	require.NoError(t, err)
}
