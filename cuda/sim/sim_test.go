// SPDX-License-Identifier: Apache-2.0

package sim_test

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

const (
	mib = uint64(1) << 20
	gib = uint64(1) << 30
)

// thread runs functions on one goroutine locked to its own OS thread, standing
// for a CUDA host thread. It never unlocks, so the OS thread exits with the
// goroutine and its id cannot carry capture state into another test.
type thread struct {
	tid  int
	work chan func()
}

func newThread(t *testing.T) *thread {
	t.Helper()
	th := &thread{work: make(chan func())}
	ready := make(chan int)
	go func() {
		runtime.LockOSThread()
		ready <- syscall.Gettid()
		for f := range th.work {
			f()
		}
	}()
	th.tid = <-ready
	t.Cleanup(func() { close(th.work) })
	return th
}

// do runs f on the thread and waits for it. f must not call t.FailNow
// (require), which is only legal on the test's goroutine.
func (th *thread) do(f func()) {
	done := make(chan struct{})
	th.work <- func() {
		defer close(done)
		f()
	}
	<-done
}

func TestDefaults(t *testing.T) {
	d := sim.New(sim.Options{})
	n, err := d.DeviceCount()
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.Equal(t, 80*gib, d.Capacity(0))
	free, total, err := d.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, 80*gib, free)
	assert.Equal(t, 80*gib, total)

	d = sim.New(sim.Options{Devices: 3, Memory: 4 * gib})
	n, err = d.DeviceCount()
	require.NoError(t, err)
	assert.Equal(t, 3, n)
	assert.Equal(t, 4*gib, d.Capacity(2))
}

func TestBadDevice(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2})
	e, err := d.EventCreate(0)
	require.NoError(t, err)
	for _, dev := range []int{-1, 2} {
		_, _, err := d.MemGetInfo(dev)
		assert.ErrorIs(t, err, cuda.ErrInvalidDevice)
		_, err = d.MemAlloc(dev, mib)
		assert.ErrorIs(t, err, cuda.ErrInvalidDevice)
		assert.ErrorIs(t, d.MemFree(dev, 1), cuda.ErrInvalidDevice)
		assert.ErrorIs(t, d.DeviceSynchronize(dev), cuda.ErrInvalidDevice)
		_, _, err = d.StreamCaptureInfo(dev, 1)
		assert.ErrorIs(t, err, cuda.ErrInvalidDevice)
		_, err = d.EventCreate(dev)
		assert.ErrorIs(t, err, cuda.ErrInvalidDevice)
		assert.ErrorIs(t, d.EventRecord(dev, e, 1), cuda.ErrInvalidDevice)
		_, err = d.EventQuery(dev, e)
		assert.ErrorIs(t, err, cuda.ErrInvalidDevice)
		assert.ErrorIs(t, d.EventSynchronize(dev, e), cuda.ErrInvalidDevice)
		assert.ErrorIs(t, d.EventDestroy(dev, e), cuda.ErrInvalidDevice)
		_, err = d.DeviceProcesses(dev)
		assert.ErrorIs(t, err, cuda.ErrInvalidDevice)
		assert.Panics(t, func() { d.Used(dev) })
	}
	assert.Equal(t, 1, d.LiveEvents(), "failed calls must not destroy the event")
}

func TestCapacityAndOOM(t *testing.T) {
	d := sim.New(sim.Options{Memory: 10 * mib})
	p1, err := d.MemAlloc(0, 6*mib)
	require.NoError(t, err)
	_, err = d.MemAlloc(0, 5*mib)
	assert.ErrorIs(t, err, cuda.ErrOutOfMemory)
	p2, err := d.MemAlloc(0, 4*mib)
	require.NoError(t, err)

	free, total, err := d.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, uint64(0), free)
	assert.Equal(t, 10*mib, total)
	assert.Equal(t, 10*mib, d.Used(0))
	assert.Equal(t, 2, d.Live(0))
	assert.Equal(t, int64(2), d.Allocs(0))

	require.NoError(t, d.MemFree(0, p1))
	free, _, err = d.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, 6*mib, free)
	assert.Equal(t, 4*mib, d.Used(0))
	assert.Equal(t, 1, d.Live(0))
	assert.Equal(t, int64(1), d.Frees(0))

	_, err = d.MemAlloc(0, 0)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue)
	require.NoError(t, d.MemFree(0, p2))
	assert.Equal(t, uint64(0), d.Used(0))
	assert.Equal(t, int64(2), d.Allocs(0), "failed allocations are not counted")
}

func TestFailAllocs(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2})
	d.FailAllocs(0, 2)
	for range 2 {
		_, err := d.MemAlloc(0, mib)
		assert.ErrorIs(t, err, cuda.ErrOutOfMemory)
	}
	_, err := d.MemAlloc(1, mib)
	assert.NoError(t, err, "injected failures are per device")
	_, err = d.MemAlloc(0, mib)
	assert.NoError(t, err)
	assert.Equal(t, int64(1), d.Allocs(0))
	assert.Equal(t, mib, d.Used(0))

	// A call refused for another reason does not use up an injected failure.
	d.FailAllocs(0, 1)
	_, err = d.MemAlloc(0, 0)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue)
	_, err = d.MemAlloc(0, mib)
	assert.ErrorIs(t, err, cuda.ErrOutOfMemory)
}

func TestExternalUse(t *testing.T) {
	d := sim.New(sim.Options{Memory: 100 * mib})
	ps, err := d.DeviceProcesses(0)
	require.NoError(t, err)
	assert.Equal(t, []cuda.ProcessMemory{{PID: uint32(os.Getpid()), Bytes: 0}}, ps)

	_, err = d.MemAlloc(0, 30*mib)
	require.NoError(t, err)
	d.SetExternalUse(0, 60*mib)
	free, total, err := d.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, 10*mib, free)
	assert.Equal(t, 100*mib, total)

	_, err = d.MemAlloc(0, 11*mib)
	assert.ErrorIs(t, err, cuda.ErrOutOfMemory, "memory held by another process is not ours to allocate")
	_, err = d.MemAlloc(0, 10*mib)
	assert.NoError(t, err)

	ps, err = d.DeviceProcesses(0)
	require.NoError(t, err)
	assert.ElementsMatch(t, []cuda.ProcessMemory{
		{PID: sim.ExternalPID, Bytes: 60 * mib},
		{PID: uint32(os.Getpid()), Bytes: 40 * mib},
	}, ps)

	// External use beyond what is left clamps free at zero.
	d.SetExternalUse(0, 100*mib)
	free, _, err = d.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, uint64(0), free)
	_, err = d.MemAlloc(0, 1)
	assert.ErrorIs(t, err, cuda.ErrOutOfMemory)

	d.SetExternalUse(0, 0)
	ps, err = d.DeviceProcesses(0)
	require.NoError(t, err)
	assert.Len(t, ps, 1)
}

func TestAddressesNeverOverlapNorRepeat(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2, Memory: gib})
	type span struct{ lo, hi uint64 }
	seen := map[int][]span{}
	alloc := func(dev int, size uint64) cuda.Ptr {
		p, err := d.MemAlloc(dev, size)
		require.NoError(t, err)
		lo := uint64(p)
		assert.Zero(t, lo%(2*mib), "allocations are 2 MiB aligned")
		assert.GreaterOrEqual(t, lo, uint64(dev+1)<<44)
		assert.Less(t, lo+size, uint64(dev+2)<<44)
		for dv, spans := range seen {
			for _, s := range spans {
				assert.False(t, lo < s.hi && s.lo < lo+size,
					"[%#x,%#x) on device %d overlaps [%#x,%#x) on device %d", lo, lo+size, dev, s.lo, s.hi, dv)
			}
		}
		seen[dev] = append(seen[dev], span{lo, lo + size})
		return p
	}
	for round := range 3 {
		var ps []cuda.Ptr
		for _, size := range []uint64{1, 2 * mib, 2*mib + 1, 3 * mib, 64 * mib} {
			ps = append(ps, alloc(round%2, size), alloc(1-round%2, size))
		}
		// Free everything: later rounds must still get fresh addresses.
		for i, p := range ps {
			require.NoError(t, d.MemFree((round+i)%2, p))
		}
	}
	assert.Equal(t, 0, d.Live(0)+d.Live(1))
}

func TestBadFree(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2})
	p, err := d.MemAlloc(0, mib)
	require.NoError(t, err)
	assert.ErrorIs(t, d.MemFree(0, p+1), cuda.ErrInvalidValue, "interior pointer")
	assert.ErrorIs(t, d.MemFree(1, p), cuda.ErrInvalidValue, "another device's pointer")
	assert.ErrorIs(t, d.MemFree(0, 0), cuda.ErrInvalidValue)
	require.NoError(t, d.MemFree(0, p))
	assert.ErrorIs(t, d.MemFree(0, p), cuda.ErrInvalidValue, "double free")
	assert.Equal(t, int64(1), d.Frees(0))
	assert.Equal(t, uint64(0), d.Used(0))
}

func query(t *testing.T, d *sim.Driver, e cuda.Event) bool {
	t.Helper()
	done, err := d.EventQuery(0, e)
	require.NoError(t, err)
	return done
}

func TestEventCompletion(t *testing.T) {
	d := sim.New(sim.Options{})
	ev := func() cuda.Event {
		e, err := d.EventCreate(0)
		require.NoError(t, err)
		return e
	}
	const s, other = cuda.Stream(5), cuda.Stream(6)

	never := ev()
	assert.True(t, query(t, d, never), "a never-recorded event is complete")

	idle := ev()
	require.NoError(t, d.EventRecord(0, idle, s))
	assert.True(t, query(t, d, idle), "recorded on an idle stream")

	d.Submit(s)
	e1 := ev()
	require.NoError(t, d.EventRecord(0, e1, s))
	d.Submit(s)
	e2 := ev()
	require.NoError(t, d.EventRecord(0, e2, s))
	assert.False(t, query(t, d, e1))
	assert.False(t, query(t, d, e2))

	d.Complete(other)
	assert.False(t, query(t, d, e1), "other streams' completion does not count")

	d.Complete(s)
	assert.True(t, query(t, d, e1))
	assert.True(t, query(t, d, e2))

	// Complete covers only work submitted before it.
	d.Submit(s)
	e3 := ev()
	require.NoError(t, d.EventRecord(0, e3, s))
	assert.False(t, query(t, d, e3))
	assert.True(t, query(t, d, e1))

	// Re-recording moves the snapshot.
	require.NoError(t, d.EventRecord(0, e1, s))
	assert.False(t, query(t, d, e1))

	// EventSynchronize waits for its own event, not for later work.
	d.Submit(s)
	e4 := ev()
	require.NoError(t, d.EventRecord(0, e4, s))
	require.NoError(t, d.EventSynchronize(0, e3))
	assert.True(t, query(t, d, e3))
	assert.False(t, query(t, d, e4))

	d.Submit(other)
	e5 := ev()
	require.NoError(t, d.EventRecord(0, e5, other))
	d.CompleteAll()
	assert.True(t, query(t, d, e4))
	assert.True(t, query(t, d, e5))
}

func TestDeviceSynchronize(t *testing.T) {
	d := sim.New(sim.Options{})
	var es []cuda.Event
	for s := cuda.Stream(0); s < 4; s++ {
		d.Submit(s)
		e, err := d.EventCreate(0)
		require.NoError(t, err)
		require.NoError(t, d.EventRecord(0, e, s))
		assert.False(t, query(t, d, e))
		es = append(es, e)
	}
	require.NoError(t, d.DeviceSynchronize(0))
	for _, e := range es {
		assert.True(t, query(t, d, e))
	}
}

func TestEventLifecycle(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2})
	seen := map[cuda.Event]bool{}
	var es []cuda.Event
	for i := range 10 {
		e, err := d.EventCreate(i % 2)
		require.NoError(t, err)
		assert.NotZero(t, e)
		assert.False(t, seen[e], "handle %d handed out twice", e)
		seen[e] = true
		es = append(es, e)
	}
	assert.Equal(t, 10, d.LiveEvents())

	// An event belongs to the device it was created on.
	assert.ErrorIs(t, d.EventRecord(1, es[0], 1), cuda.ErrInvalidHandle)
	_, err := d.EventQuery(0, es[1])
	assert.ErrorIs(t, err, cuda.ErrInvalidHandle)

	require.NoError(t, d.EventDestroy(0, es[0]))
	assert.Equal(t, 9, d.LiveEvents())
	assert.ErrorIs(t, d.EventDestroy(0, es[0]), cuda.ErrInvalidHandle)
	assert.ErrorIs(t, d.EventRecord(0, es[0], 1), cuda.ErrInvalidHandle)
	_, err = d.EventQuery(0, es[0])
	assert.ErrorIs(t, err, cuda.ErrInvalidHandle)
	assert.ErrorIs(t, d.EventSynchronize(0, es[0]), cuda.ErrInvalidHandle)
	_, err = d.EventQuery(0, 12345)
	assert.ErrorIs(t, err, cuda.ErrInvalidHandle)
	assert.Equal(t, 9, d.LiveEvents())

	e, err := d.EventCreate(0)
	require.NoError(t, err)
	assert.False(t, seen[e], "handles are not reused after destroy")
}

// A stream the application destroyed must not be named again: each call
// that does is refused and is a violation. Its queued work still completes,
// and an event recorded on it before stays valid.
func TestDestroyedStream(t *testing.T) {
	d := sim.New(sim.Options{})
	e, err := d.EventCreate(0)
	require.NoError(t, err)
	d.Submit(7)
	require.NoError(t, d.EventRecord(0, e, 7))
	d.DestroyStream(7)
	require.Zero(t, d.Violations(), "destroying names nothing")

	done, err := d.EventQuery(0, e)
	require.NoError(t, err, "an event recorded before stays valid")
	require.False(t, done)
	d.Complete(7)
	done, err = d.EventQuery(0, e)
	require.NoError(t, err)
	require.True(t, done, "the queued work completes")

	require.ErrorIs(t, d.EventRecord(0, e, 7), cuda.ErrInvalidHandle)
	_, _, err = d.StreamCaptureInfo(0, 7)
	require.ErrorIs(t, err, cuda.ErrInvalidHandle)
	require.ErrorIs(t, d.StreamSynchronize(0, 7), cuda.ErrInvalidHandle)
	require.ErrorIs(t, d.StreamWaitEvent(0, 7, e), cuda.ErrInvalidHandle)
	require.Equal(t, int64(4), d.Violations())
	require.Contains(t, d.ViolationLog()[0], "EventRecord(dev=0, event=1): stream 0x7 was destroyed")

	require.NoError(t, d.EventRecord(0, e, 8), "other streams are untouched")
	s, err := d.StreamCreate(0)
	require.NoError(t, err)
	require.NoError(t, d.StreamSynchronize(0, s))
	require.NoError(t, d.StreamDestroy(0, s))
	require.ErrorIs(t, d.StreamSynchronize(0, s), cuda.ErrInvalidHandle, "nor may one StreamCreate made, once destroyed")
	require.Equal(t, int64(5), d.Violations())
}

func TestCaptureIDsAndState(t *testing.T) {
	d := sim.New(sim.Options{})
	th := newThread(t)
	info := func(s cuda.Stream) (cuda.CaptureStatus, uint64) {
		st, id, err := d.StreamCaptureInfo(0, s)
		require.NoError(t, err)
		return st, id
	}
	th.do(func() {
		assert.NoError(t, d.BeginCapture(1, cuda.CaptureModeGlobal))
		assert.NoError(t, d.BeginCapture(2, cuda.CaptureModeThreadLocal))
	})
	st, id := info(1)
	assert.Equal(t, cuda.CaptureActive, st)
	assert.Equal(t, uint64(1), id)
	st, id = info(2)
	assert.Equal(t, cuda.CaptureActive, st)
	assert.Equal(t, uint64(2), id)
	st, id = info(3)
	assert.Equal(t, cuda.CaptureNone, st)
	assert.Zero(t, id)
	assert.Equal(t, 2, d.ActiveCaptures())

	th.do(func() {
		assert.ErrorIs(t, d.BeginCapture(1, cuda.CaptureModeGlobal), cuda.ErrInvalidValue, "already capturing")
		assert.ErrorIs(t, d.BeginCapture(3, cuda.CaptureMode(7)), cuda.ErrInvalidValue)
		assert.ErrorIs(t, d.BeginCapture(0, cuda.CaptureModeRelaxed), cuda.ErrCaptureUnsupported, "legacy stream")
		assert.NoError(t, d.EndCapture(1))
		assert.ErrorIs(t, d.EndCapture(1), cuda.ErrInvalidValue, "not capturing")
		assert.NoError(t, d.BeginCapture(1, cuda.CaptureModeRelaxed))
	})
	st, id = info(1)
	assert.Equal(t, cuda.CaptureActive, st)
	assert.Equal(t, uint64(3), id, "ids increase and are never reused")
	th.do(func() {
		assert.NoError(t, d.EndCapture(1))
		assert.NoError(t, d.EndCapture(2))
	})
	st, id = info(1)
	assert.Equal(t, cuda.CaptureNone, st)
	assert.Zero(t, id)
	assert.Equal(t, 0, d.ActiveCaptures())
	assert.Zero(t, d.Violations())
}

func TestExchangeCaptureMode(t *testing.T) {
	d := sim.New(sim.Options{})
	a, b := newThread(t), newThread(t)
	a.do(func() {
		prev, err := d.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
		assert.NoError(t, err)
		assert.Equal(t, cuda.CaptureModeGlobal, prev, "threads start in global mode")
		prev, err = d.ExchangeCaptureMode(cuda.CaptureModeThreadLocal)
		assert.NoError(t, err)
		assert.Equal(t, cuda.CaptureModeRelaxed, prev)
		prev, err = d.ExchangeCaptureMode(cuda.CaptureMode(-1))
		assert.ErrorIs(t, err, cuda.ErrInvalidValue)
		assert.Equal(t, cuda.CaptureModeThreadLocal, prev)
	})
	b.do(func() {
		prev, err := d.ExchangeCaptureMode(cuda.CaptureModeGlobal)
		assert.NoError(t, err)
		assert.Equal(t, cuda.CaptureModeGlobal, prev, "modes are per thread")
	})
	a.do(func() {
		prev, err := d.ExchangeCaptureMode(cuda.CaptureModeGlobal)
		assert.NoError(t, err)
		assert.Equal(t, cuda.CaptureModeThreadLocal, prev, "an invalid mode changes nothing")
	})
}

// unsafeCalls are the potentially unsafe calls. Each makes its call with e,
// an event recorded outside capture on a stream with pending work, and
// reports its error; the caller checks whether it had an effect.
var unsafeCalls = []struct {
	name string
	call func(d *sim.Driver, e cuda.Event) error
}{
	{"MemAlloc", func(d *sim.Driver, _ cuda.Event) error { _, err := d.MemAlloc(0, mib); return err }},
	{"EventQuery", func(d *sim.Driver, e cuda.Event) error { _, err := d.EventQuery(0, e); return err }},
	{"EventSynchronize", func(d *sim.Driver, e cuda.Event) error { return d.EventSynchronize(0, e) }},
	{"DeviceSynchronize", func(d *sim.Driver, _ cuda.Event) error { return d.DeviceSynchronize(0) }},
}

func TestCaptureModeRules(t *testing.T) {
	const (
		G = cuda.CaptureModeGlobal
		L = cuda.CaptureModeThreadLocal
		R = cuda.CaptureModeRelaxed
	)
	// Written out rather than derived, from CUDA's documentation of
	// cudaStreamCaptureMode.
	cases := []struct {
		capture    cuda.CaptureMode // mode the capture was begun in
		sameThread bool             // whether the caller began it
		caller     cuda.CaptureMode // the calling thread's mode
		prohibited bool
	}{
		{G, true, G, true},
		{G, true, L, true},
		{G, true, R, false},
		{L, true, G, true},
		{L, true, L, true},
		{L, true, R, false},
		{R, true, G, false},
		{R, true, L, false},
		{R, true, R, false},
		{G, false, G, true}, // another thread's global capture binds global threads
		{G, false, L, false},
		{G, false, R, false},
		{L, false, G, false}, // a thread-local capture binds only its thread
		{L, false, L, false},
		{L, false, R, false},
		{R, false, G, false},
		{R, false, L, false},
		{R, false, R, false},
	}
	for _, uc := range unsafeCalls {
		for _, c := range cases {
			where := "other"
			if c.sameThread {
				where = "same"
			}
			name := fmt.Sprintf("%s/capture=%v,%s-thread,caller=%v", uc.name, c.capture, where, c.caller)
			t.Run(name, func(t *testing.T) {
				d := sim.New(sim.Options{})
				const work, captured = cuda.Stream(3), cuda.Stream(7)
				d.Submit(work)
				e, err := d.EventCreate(0)
				require.NoError(t, err)
				require.NoError(t, d.EventRecord(0, e, work))

				capThread := newThread(t)
				caller := capThread
				if !c.sameThread {
					caller = newThread(t)
				}
				var beginErr, modeErr, callErr, endErr error
				capThread.do(func() { beginErr = d.BeginCapture(captured, c.capture) })
				require.NoError(t, beginErr)
				caller.do(func() {
					_, modeErr = d.ExchangeCaptureMode(c.caller)
					callErr = uc.call(d, e)
				})
				require.NoError(t, modeErr)
				status, _, err := d.StreamCaptureInfo(0, captured)
				require.NoError(t, err)
				capThread.do(func() { endErr = d.EndCapture(captured) })
				done := query(t, d, e) // legal now that the capture has ended

				if c.prohibited {
					assert.ErrorIs(t, callErr, cuda.ErrCaptureUnsupported)
					assert.Equal(t, int64(1), d.Violations())
					assert.Len(t, d.ViolationLog(), 1)
					assert.Equal(t, cuda.CaptureInvalidated, status)
					assert.ErrorIs(t, endErr, cuda.ErrCaptureInvalidated)
					assert.Zero(t, d.Live(0), "a refused call does nothing")
					assert.False(t, done, "a refused call does nothing")
				} else {
					assert.NoError(t, callErr)
					assert.Zero(t, d.Violations(), "%v", d.ViolationLog())
					assert.Equal(t, cuda.CaptureActive, status)
					assert.NoError(t, endErr)
					switch uc.name {
					case "MemAlloc":
						assert.Equal(t, 1, d.Live(0))
					case "EventSynchronize", "DeviceSynchronize":
						assert.True(t, done)
					}
				}
				assert.Zero(t, d.ActiveCaptures())
			})
		}
	}
}

func TestProhibitionInvalidatesOnlyCulprits(t *testing.T) {
	d := sim.New(sim.Options{})
	a, b := newThread(t), newThread(t)
	a.do(func() {
		assert.NoError(t, d.BeginCapture(1, cuda.CaptureModeGlobal))
		assert.NoError(t, d.BeginCapture(2, cuda.CaptureModeRelaxed))
	})
	b.do(func() { assert.NoError(t, d.BeginCapture(3, cuda.CaptureModeThreadLocal)) })

	// b is global: a's global capture and b's own thread-local one forbid it;
	// a's relaxed capture does not.
	var err error
	b.do(func() { _, err = d.MemAlloc(0, mib) })
	assert.ErrorIs(t, err, cuda.ErrCaptureUnsupported)
	for s, want := range map[cuda.Stream]cuda.CaptureStatus{
		1: cuda.CaptureInvalidated,
		2: cuda.CaptureActive,
		3: cuda.CaptureInvalidated,
	} {
		st, _, err := d.StreamCaptureInfo(0, s)
		require.NoError(t, err)
		assert.Equal(t, want, st, "stream %d", s)
	}
	log := d.ViolationLog()
	require.Len(t, log, 1)
	assert.Contains(t, log[0], "MemAlloc")
	assert.Contains(t, log[0], fmt.Sprintf("thread %d", b.tid))
	assert.Contains(t, log[0], "capture 1 ")
	assert.Contains(t, log[0], "capture 3 ")
	assert.NotContains(t, log[0], "capture 2 ")

	d.ResetViolations()
	assert.Zero(t, d.Violations())
	assert.Empty(t, d.ViolationLog())
	st, _, err := d.StreamCaptureInfo(0, 1)
	require.NoError(t, err)
	assert.Equal(t, cuda.CaptureInvalidated, st, "reset does not revive captures")
}

func TestFreeDuringAnyCapture(t *testing.T) {
	d := sim.New(sim.Options{})
	p, err := d.MemAlloc(0, mib)
	require.NoError(t, err)
	a, b := newThread(t), newThread(t)
	a.do(func() { assert.NoError(t, d.BeginCapture(1, cuda.CaptureModeRelaxed)) })
	b.do(func() { assert.NoError(t, d.BeginCapture(2, cuda.CaptureModeRelaxed)) })

	// Even the most permissive modes do not allow a free.
	var freeErr error
	caller := newThread(t)
	caller.do(func() {
		_, err := d.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
		assert.NoError(t, err)
		freeErr = d.MemFree(0, p)
	})
	assert.ErrorIs(t, freeErr, cuda.ErrCaptureUnsupported)
	assert.Equal(t, int64(1), d.Violations())
	assert.Equal(t, 1, d.Live(0), "a refused free frees nothing")
	assert.Zero(t, d.Frees(0))
	require.Len(t, d.ViolationLog(), 1)
	assert.Contains(t, d.ViolationLog()[0], "MemFree")

	var endA, endB error
	a.do(func() { endA = d.EndCapture(1) })
	b.do(func() { endB = d.EndCapture(2) })
	assert.ErrorIs(t, endA, cuda.ErrCaptureInvalidated, "every capture is invalidated")
	assert.ErrorIs(t, endB, cuda.ErrCaptureInvalidated)

	require.NoError(t, d.MemFree(0, p), "free is legal again once capture ends")
	assert.Zero(t, d.Live(0))
}

func TestCapturedEvent(t *testing.T) {
	d := sim.New(sim.Options{})
	th := newThread(t)
	const s = cuda.Stream(9)
	e, err := d.EventCreate(0)
	require.NoError(t, err)

	var recErr, queryErr, syncErr error
	th.do(func() {
		// Relaxed, so that only the captured-event rule applies.
		_, err := d.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
		assert.NoError(t, err)
		assert.NoError(t, d.BeginCapture(s, cuda.CaptureModeGlobal))
		d.Submit(s) // captured, not enqueued
		recErr = d.EventRecord(0, e, s)
		_, queryErr = d.EventQuery(0, e)
		syncErr = d.EventSynchronize(0, e)
	})
	require.NoError(t, recErr, "recording on a capturing stream is legal")
	assert.ErrorIs(t, queryErr, cuda.ErrCapturedEvent)
	assert.ErrorIs(t, syncErr, cuda.ErrCapturedEvent)
	assert.Equal(t, int64(2), d.Violations())
	st, _, err := d.StreamCaptureInfo(0, s)
	require.NoError(t, err)
	assert.Equal(t, cuda.CaptureActive, st, "a captured-event error does not invalidate")

	var endErr error
	th.do(func() { endErr = d.EndCapture(s) })
	require.NoError(t, endErr)
	_, err = d.EventQuery(0, e)
	assert.ErrorIs(t, err, cuda.ErrCapturedEvent, "still captured until re-recorded")
	assert.Equal(t, int64(3), d.Violations())

	require.NoError(t, d.EventRecord(0, e, s))
	assert.True(t, query(t, d, e), "work submitted during capture was not enqueued")
	require.NoError(t, d.EventDestroy(0, e))
}

func TestRecordOnInvalidatedCapture(t *testing.T) {
	d := sim.New(sim.Options{})
	th := newThread(t)
	e, err := d.EventCreate(0)
	require.NoError(t, err)
	var recErr, endErr error
	th.do(func() {
		assert.NoError(t, d.BeginCapture(4, cuda.CaptureModeGlobal))
		_, err := d.MemAlloc(0, mib)
		assert.ErrorIs(t, err, cuda.ErrCaptureUnsupported)
		recErr = d.EventRecord(0, e, 4)
		endErr = d.EndCapture(4)
	})
	assert.ErrorIs(t, recErr, cuda.ErrCaptureInvalidated)
	assert.ErrorIs(t, endErr, cuda.ErrCaptureInvalidated)
	assert.Zero(t, d.ActiveCaptures(), "EndCapture ends an invalidated capture")
}

func TestEndCaptureWrongThread(t *testing.T) {
	d := sim.New(sim.Options{})
	a, b := newThread(t), newThread(t)
	a.do(func() {
		assert.NoError(t, d.BeginCapture(1, cuda.CaptureModeThreadLocal))
		assert.NoError(t, d.BeginCapture(2, cuda.CaptureModeRelaxed))
	})
	var err1, err2 error
	b.do(func() {
		err1 = d.EndCapture(1)
		err2 = d.EndCapture(2)
	})
	assert.ErrorIs(t, err1, cuda.ErrCaptureWrongThread)
	assert.NoError(t, err2, "a relaxed capture may end on any thread")
	assert.Equal(t, 1, d.ActiveCaptures())
	a.do(func() { err1 = d.EndCapture(1) })
	assert.NoError(t, err1)
	assert.Zero(t, d.ActiveCaptures())
}

func TestConcurrentUse(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2, Memory: 64 * gib})
	const workers, iters = 8, 200
	ptrs := make([][]cuda.Ptr, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			dev, s := w%2, cuda.Stream(w+1)
			for range iters {
				p, err := d.MemAlloc(dev, mib)
				if !assert.NoError(t, err) {
					return
				}
				ptrs[w] = append(ptrs[w], p)
				e, err := d.EventCreate(dev)
				assert.NoError(t, err)
				d.Submit(s)
				assert.NoError(t, d.EventRecord(dev, e, s))
				done, err := d.EventQuery(dev, e)
				assert.NoError(t, err)
				assert.False(t, done, "only this worker completes its stream")
				d.Complete(s)
				done, err = d.EventQuery(dev, e)
				assert.NoError(t, err)
				assert.True(t, done)
				assert.NoError(t, d.EventDestroy(dev, e))
				assert.NoError(t, d.MemFree(dev, p))
			}
		})
	}
	wg.Go(func() {
		for range iters {
			_, _, err := d.MemGetInfo(0)
			assert.NoError(t, err)
			_, err = d.DeviceProcesses(1)
			assert.NoError(t, err)
			_ = d.Used(0)
			_ = d.LiveEvents()
		}
	})
	wg.Wait()

	seen := map[cuda.Ptr]bool{}
	for _, ps := range ptrs {
		for _, p := range ps {
			assert.False(t, seen[p], "address %#x handed out twice", p)
			seen[p] = true
		}
	}
	assert.Len(t, seen, workers*iters)
	assert.Equal(t, int64(workers*iters/2), d.Allocs(0))
	assert.Equal(t, d.Allocs(0), d.Frees(0))
	assert.Equal(t, d.Allocs(1), d.Frees(1))
	assert.Zero(t, d.Live(0)+d.Live(1))
	assert.Zero(t, d.Used(0)+d.Used(1))
	assert.Zero(t, d.LiveEvents())
	assert.Zero(t, d.Violations())
}

// Thread-local captures on their own threads must never bind global-mode
// threads elsewhere, however the two interleave.
func TestConcurrentThreadLocalCaptures(t *testing.T) {
	d := sim.New(sim.Options{})
	const capturers, workers, iters = 4, 4, 100
	var mu sync.Mutex
	ids := map[uint64]bool{}
	var wg sync.WaitGroup
	for c := range capturers {
		th := newThread(t)
		wg.Go(func() {
			s := cuda.Stream(100 + c)
			th.do(func() {
				for range iters {
					if !assert.NoError(t, d.BeginCapture(s, cuda.CaptureModeThreadLocal)) {
						return
					}
					st, id, err := d.StreamCaptureInfo(0, s)
					assert.NoError(t, err)
					assert.Equal(t, cuda.CaptureActive, st)
					mu.Lock()
					assert.False(t, ids[id], "capture id %d reused", id)
					ids[id] = true
					mu.Unlock()
					assert.NoError(t, d.EndCapture(s))
				}
			})
		})
	}
	ptrs := make([][]cuda.Ptr, workers)
	for w := range workers {
		th := newThread(t) // never a capturing thread
		wg.Go(func() {
			th.do(func() {
				for range iters {
					p, err := d.MemAlloc(0, mib)
					if !assert.NoError(t, err) {
						return
					}
					ptrs[w] = append(ptrs[w], p)
					assert.NoError(t, d.DeviceSynchronize(0))
				}
			})
		})
	}
	wg.Wait()
	assert.Zero(t, d.Violations(), "%v", d.ViolationLog())
	assert.Len(t, ids, capturers*iters)
	assert.Zero(t, d.ActiveCaptures())
	for _, ps := range ptrs {
		for _, p := range ps {
			require.NoError(t, d.MemFree(0, p))
		}
	}
	assert.Zero(t, d.Live(0))
}
