//go:build linux && cgo

package driver_test

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"testing"

	"github.com/ebitengine/purego"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/driver"
)

// These tests need a GPU and skip without one.

func openGPU(t testing.TB) *driver.Driver {
	t.Helper()
	d, err := driver.Open()
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	if n, _ := d.DeviceCount(); n == 0 {
		t.Skip("no CUDA driver: no devices")
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	})
	return d
}

// rawCUDA is the part of the driver API the tests use directly, through
// purego (slow, allocating; fine for tests).
type rawCUDA struct {
	deviceGet          func(*int32, int32) int32
	primaryCtxRetain   func(*uintptr, int32) int32
	primaryCtxRelease  func(int32) int32
	ctxGetCurrent      func(*uintptr) int32
	ctxPushCurrent     func(uintptr) int32
	ctxPopCurrent      func(*uintptr) int32
	streamCreate       func(*uintptr, uint32) int32
	streamDestroy      func(uintptr) int32
	streamBeginCapture func(uintptr, int32) int32
	streamEndCapture   func(uintptr, *uintptr) int32
	graphDestroy       func(uintptr) int32
}

func openRaw(t testing.TB) *rawCUDA {
	t.Helper()
	h, err := purego.Dlopen(driver.LibraryName, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	r := &rawCUDA{}
	for name, fn := range map[string]any{
		"cuDeviceGet":                  &r.deviceGet,
		"cuDevicePrimaryCtxRetain":     &r.primaryCtxRetain,
		"cuDevicePrimaryCtxRelease_v2": &r.primaryCtxRelease,
		"cuCtxGetCurrent":              &r.ctxGetCurrent,
		"cuCtxPushCurrent_v2":          &r.ctxPushCurrent,
		"cuCtxPopCurrent_v2":           &r.ctxPopCurrent,
		"cuStreamCreate":               &r.streamCreate,
		"cuStreamDestroy_v2":           &r.streamDestroy,
		"cuStreamBeginCapture_v2":      &r.streamBeginCapture,
		"cuStreamEndCapture":           &r.streamEndCapture,
		"cuGraphDestroy":               &r.graphDestroy,
	} {
		purego.RegisterLibFunc(fn, h, name)
	}
	return r
}

func (r *rawCUDA) current() uintptr {
	var c uintptr
	r.ctxGetCurrent(&c)
	return c
}

func TestGPUOpen(t *testing.T) {
	d := openGPU(t)
	n, _ := d.DeviceCount()
	t.Logf("driver version %d, %d device(s), capture info via %s", d.Version(), n, d.CaptureInfoEntryPoint())
	for dev := range n {
		free, total, err := d.MemGetInfo(dev)
		if err != nil || total == 0 || free > total {
			t.Fatalf("MemGetInfo(%d) = %d, %d, %v", dev, free, total, err)
		}
		id, err := d.PCIBusID(dev)
		t.Logf("device %d: %s, %d of %d MiB free", dev, id, free>>20, total>>20)
		if err != nil {
			t.Error(err)
		}
	}
	if _, _, err := d.MemGetInfo(n); !errors.Is(err, cuda.ErrInvalidDevice) {
		t.Errorf("MemGetInfo(%d): %v", n, err)
	}
}

func TestGPUMemoryEventsAndContext(t *testing.T) {
	d := openGPU(t)
	raw := openRaw(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if c := raw.current(); c != 0 {
		t.Skipf("thread already has context %#x", c)
	}

	p, err := d.MemAlloc(0, 1<<20)
	if err != nil || p == 0 {
		t.Fatalf("MemAlloc = %#x, %v", p, err)
	}
	if c := raw.current(); c != 0 {
		t.Fatalf("MemAlloc left context %#x current", c)
	}
	if _, err := d.MemAlloc(0, 1<<50); !errors.Is(err, cuda.ErrOutOfMemory) {
		t.Errorf("1 PiB MemAlloc: %v", err)
	}
	e, err := d.EventCreate(0)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.EventRecord(0, e, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.EventSynchronize(0, e); err != nil {
		t.Fatal(err)
	}
	if done, err := d.EventQuery(0, e); !done || err != nil {
		t.Fatalf("EventQuery after EventSynchronize = %v, %v", done, err)
	}
	if err := d.DeviceSynchronize(0); err != nil {
		t.Fatal(err)
	}
	if err := d.EventDestroy(0, e); err != nil {
		t.Fatal(err)
	}
	if err := d.MemFree(0, p); err != nil {
		t.Fatal(err)
	}
	if c := raw.current(); c != 0 {
		t.Fatalf("calls left context %#x current", c)
	}

	// With the last device's primary context current, device 0 calls must
	// restore it (with one GPU this is the no-push path).
	n, _ := d.DeviceCount()
	var last int32
	raw.deviceGet(&last, int32(n-1))
	var ctx uintptr
	if r := raw.primaryCtxRetain(&ctx, last); r != 0 {
		t.Fatalf("cuDevicePrimaryCtxRetain: %d", r)
	}
	defer raw.primaryCtxRelease(last)
	raw.ctxPushCurrent(ctx)
	p, err = d.MemAlloc(0, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.MemFree(0, p); err != nil {
		t.Fatal(err)
	}
	if c := raw.current(); c != ctx {
		t.Fatalf("current context %#x, want %#x", c, ctx)
	}
	var popped uintptr
	raw.ctxPopCurrent(&popped)
}

// TestGPUCapture runs with the entry point Open picks (the v2 ABI, API
// version 12000) and again with the one API version 13000 yields (v3, with
// edge data, on CUDA 13 drivers): the call in cp_stream_capture_info must
// be right for both.
func TestGPUCapture(t *testing.T) {
	for _, version := range []int{0, 13000} {
		t.Run(fmt.Sprint(version), func(t *testing.T) {
			d := openGPU(t)
			if version != 0 {
				if d.Version() < version {
					t.Skipf("driver %d is older than API version %d", d.Version(), version)
				}
				if err := d.ResolveCaptureInfo(version); err != nil {
					t.Fatal(err)
				}
			}
			t.Logf("capture info via %s", d.CaptureInfoEntryPoint())
			testGPUCapture(t, d)
		})
	}
}

func testGPUCapture(t *testing.T, d *driver.Driver) {
	raw := openRaw(t)
	runtime.LockOSThread() // capture mode and context are per thread
	defer runtime.UnlockOSThread()

	var dev int32
	raw.deviceGet(&dev, 0)
	var ctx uintptr
	if r := raw.primaryCtxRetain(&ctx, dev); r != 0 {
		t.Fatalf("cuDevicePrimaryCtxRetain: %d", r)
	}
	defer raw.primaryCtxRelease(dev)
	raw.ctxPushCurrent(ctx)
	defer func() { var c uintptr; raw.ctxPopCurrent(&c) }()

	var s uintptr
	if r := raw.streamCreate(&s, 1 /* CU_STREAM_NON_BLOCKING */); r != 0 {
		t.Fatalf("cuStreamCreate: %d", r)
	}
	defer raw.streamDestroy(s)

	if st, id, err := d.StreamCaptureInfo(0, cuda.Stream(s)); st != cuda.CaptureNone || id != 0 || err != nil {
		t.Fatalf("before capture: %v, %d, %v", st, id, err)
	}
	if m, err := d.ExchangeCaptureMode(cuda.CaptureModeGlobal); err != nil || m != cuda.CaptureModeGlobal {
		t.Fatalf("thread capture mode %v, %v; want global", m, err)
	}

	if r := raw.streamBeginCapture(s, 0 /* CU_STREAM_CAPTURE_MODE_GLOBAL */); r != 0 {
		t.Fatalf("cuStreamBeginCapture_v2: %d", r)
	}
	st, id, err := d.StreamCaptureInfo(0, cuda.Stream(s))
	if st != cuda.CaptureActive || id == 0 || err != nil {
		t.Fatalf("during capture: %v, %d, %v", st, id, err)
	}
	t.Logf("capture id %d", id)
	// Legacy stream 0 is not capturing, and asking is legal.
	if st, _, err := d.StreamCaptureInfo(0, 0); st != cuda.CaptureNone || err != nil {
		t.Fatalf("stream 0 during capture: %v, %v", st, err)
	}

	// cuMemAlloc in relaxed mode does not disturb the capture.
	p, err := d.MemAllocRelaxed(0, 1<<20)
	if err != nil {
		t.Fatalf("MemAllocRelaxed during capture: %v", err)
	}
	prev, err := d.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
	if err != nil || prev != cuda.CaptureModeGlobal {
		t.Fatalf("ExchangeCaptureMode = %v, %v", prev, err)
	}
	p2, err := d.MemAlloc(0, 1<<20)
	if err != nil {
		t.Fatalf("MemAlloc in relaxed mode during capture: %v", err)
	}
	if m, err := d.ExchangeCaptureMode(prev); err != nil || m != cuda.CaptureModeRelaxed {
		t.Fatalf("exchange back = %v, %v", m, err)
	}
	if st2, id2, err := d.StreamCaptureInfo(0, cuda.Stream(s)); st2 != cuda.CaptureActive || id2 != id || err != nil {
		t.Fatalf("after relaxed allocations: %v, %d, %v", st2, id2, err)
	}

	var g uintptr
	if r := raw.streamEndCapture(s, &g); r != 0 {
		t.Fatalf("cuStreamEndCapture: %d (the capture was invalidated)", r)
	}
	raw.graphDestroy(g)
	if err := d.MemFree(0, p); err != nil {
		t.Fatal(err)
	}
	if err := d.MemFree(0, p2); err != nil {
		t.Fatal(err)
	}
}

func TestGPUHotPathDoesNotAllocate(t *testing.T) {
	d := openGPU(t)
	e, err := d.EventCreate(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.EventDestroy(0, e)
	for name, fn := range map[string]func(){
		"EventRecord":       func() { _ = d.EventRecord(0, e, 0) },
		"EventQuery":        func() { _, _ = d.EventQuery(0, e) },
		"StreamCaptureInfo": func() { _, _, _ = d.StreamCaptureInfo(0, 0) },
	} {
		if n := testing.AllocsPerRun(1000, fn); n != 0 {
			t.Errorf("%s: %v allocations per call", name, n)
		}
	}
}

func TestGPUDeviceProcesses(t *testing.T) {
	d := openGPU(t)
	p, err := d.MemAlloc(0, 64<<20) // make sure this process has a context
	if err != nil {
		t.Fatal(err)
	}
	defer d.MemFree(0, p)
	procs, err := d.DeviceProcesses(0)
	if err != nil {
		t.Skipf("NVML: %v", err)
	}
	t.Logf("pid %d; processes on device 0: %v", os.Getpid(), procs)
	// In a container NVML reports host PIDs, so only log whether we are seen.
	for _, pr := range procs {
		if pr.PID == uint32(os.Getpid()) {
			t.Logf("found this process: %d MiB", pr.Bytes>>20)
		}
	}
}

func benchGPU(b *testing.B, fn func(d *driver.Driver, e cuda.Event)) {
	d := openGPU(b)
	e, err := d.EventCreate(0)
	if err != nil {
		b.Fatal(err)
	}
	defer d.EventDestroy(0, e)
	_ = d.EventRecord(0, e, 0)
	_ = d.EventSynchronize(0, e)
	b.ReportAllocs()
	for b.Loop() {
		fn(d, e)
	}
}

func BenchmarkGPUEventQuery(b *testing.B) {
	benchGPU(b, func(d *driver.Driver, e cuda.Event) { d.EventQuery(0, e) })
}

func BenchmarkGPUEventRecord(b *testing.B) {
	benchGPU(b, func(d *driver.Driver, e cuda.Event) { d.EventRecord(0, e, 0) })
}

func BenchmarkGPUStreamCaptureInfo(b *testing.B) {
	benchGPU(b, func(d *driver.Driver, e cuda.Event) { d.StreamCaptureInfo(0, 0) })
}

func BenchmarkGPUExchangeCaptureMode(b *testing.B) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	benchGPU(b, func(d *driver.Driver, e cuda.Event) {
		m, _ := d.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
		d.ExchangeCaptureMode(m)
	})
}

// The same with device 0's primary context already current (PyTorch's usual
// state): no push/pop.
func BenchmarkGPUEventQueryContextCurrent(b *testing.B) {
	raw := openRaw(b)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var dev int32
	raw.deviceGet(&dev, 0)
	var ctx uintptr
	if r := raw.primaryCtxRetain(&ctx, dev); r != 0 {
		b.Fatalf("cuDevicePrimaryCtxRetain: %d", r)
	}
	defer raw.primaryCtxRelease(dev)
	raw.ctxPushCurrent(ctx)
	defer func() { var c uintptr; raw.ctxPopCurrent(&c) }()
	benchGPU(b, func(d *driver.Driver, e cuda.Event) { d.EventQuery(0, e) })
}

func BenchmarkGPUStreamCaptureInfoContextCurrent(b *testing.B) {
	raw := openRaw(b)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var dev int32
	raw.deviceGet(&dev, 0)
	var ctx uintptr
	if r := raw.primaryCtxRetain(&ctx, dev); r != 0 {
		b.Fatalf("cuDevicePrimaryCtxRetain: %d", r)
	}
	defer raw.primaryCtxRelease(dev)
	raw.ctxPushCurrent(ctx)
	defer func() { var c uintptr; raw.ctxPopCurrent(&c) }()
	benchGPU(b, func(d *driver.Driver, e cuda.Event) { d.StreamCaptureInfo(0, 0) })
}
