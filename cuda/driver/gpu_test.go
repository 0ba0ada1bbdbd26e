// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package driver_test

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	"github.com/ebitengine/purego"

	"github.com/cudapool/cudapool/allocator"
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
	memsetD8           func(uintptr, uint8, uintptr) int32
	memcpyDtoH         func(*byte, uintptr, uintptr) int32
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
		"cuMemsetD8_v2":                &r.memsetD8,
		"cuMemcpyDtoH_v2":              &r.memcpyDtoH,
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

// pushPrimary makes device 0's primary context current on the calling
// thread, which must be locked, until the test ends.
func (r *rawCUDA) pushPrimary(t testing.TB) {
	t.Helper()
	var dev int32
	r.deviceGet(&dev, 0)
	var ctx uintptr
	if res := r.primaryCtxRetain(&ctx, dev); res != 0 {
		t.Fatalf("cuDevicePrimaryCtxRetain: %d", res)
	}
	r.ctxPushCurrent(ctx)
	t.Cleanup(func() {
		var c uintptr
		r.ctxPopCurrent(&c)
		r.primaryCtxRelease(dev)
	})
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

// ipcHelperEnv passes TestGPUIpc's handles to its helper process.
const ipcHelperEnv = "CUDAPOOL_TEST_IPC_HELPER"

// TestGPUIpc shares memory with another process as PyTorch does: the
// allocator names a block by its segment's handle and offset, and a helper
// process (this test binary, running TestGPUIpcHelper) maps the segment,
// reads the block's bytes, and checks the rest of the IPC contract. The
// exporting process itself may only get handles: CUDA refuses a process its
// own handles.
func TestGPUIpc(t *testing.T) {
	d := openGPU(t)
	raw := openRaw(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	raw.pushPrimary(t)
	t.Logf("IPC open entry point: %s", d.IpcEntryPoint())

	buf, err := d.MemAlloc(0, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer d.MemFree(0, buf)
	h, err := d.IpcGetMemHandle(0, buf)
	if err != nil {
		t.Fatalf("IpcGetMemHandle of a cuMemAlloc buffer: %v", err)
	}
	if h == (cuda.IpcHandle{}) {
		t.Fatal("all-zero handle")
	}
	if hi, err := d.IpcGetMemHandle(0, buf+4096); err != nil || hi != h {
		t.Errorf("IpcGetMemHandle inside the buffer = %v; want the buffer's handle", err)
	}
	if _, err := d.IpcGetMemHandle(0, buf+4<<20); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("IpcGetMemHandle past the buffer: %v", err)
	}
	if q, err := d.IpcOpenMemHandle(0, h); err == nil {
		d.IpcCloseMemHandle(0, q)
		t.Error("the exporting process opened its own handle")
	} else {
		t.Logf("opening its own handle: %v", err)
	}

	// VMM memory (expandable segments) has no IPC handle.
	if g, err := d.MemGranularity(0); err == nil {
		v, err := d.MemAddressReserve(0, g)
		if err != nil {
			t.Fatal(err)
		}
		defer d.MemAddressFree(0, v, g)
		mh, err := d.MemCreate(0, g)
		if err != nil {
			t.Fatal(err)
		}
		defer d.MemRelease(0, mh)
		if err := d.MemMap(0, v, g, mh); err != nil {
			t.Fatal(err)
		}
		defer d.MemUnmap(0, v, g)
		if err := d.MemSetAccess(0, v, g); err != nil {
			t.Fatal(err)
		}
		if _, err := d.IpcGetMemHandle(0, v); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("IpcGetMemHandle of VMM memory: %v, want CUDA_ERROR_INVALID_VALUE", err)
		}
	}

	// A block that is not at its segment's start, filled with 0x5a, in a
	// cuMemAlloc'd segment (the default maps pages of expandable segments).
	cfg, _, err := allocator.ParseConfig("expandable_segments:False")
	if err != nil {
		t.Fatal(err)
	}
	a, err := allocator.New(d, cfg)
	if err != nil {
		t.Fatal(err)
	}
	a.ExpectAnnouncements()
	b1, err := a.Malloc(&allocator.MallocRequest{Size: 4096})
	if err != nil {
		t.Fatal(err)
	}
	b2, err := a.Malloc(&allocator.MallocRequest{Size: 4096})
	if err != nil {
		t.Fatal(err)
	}
	if r := raw.memsetD8(uintptr(b1), 0x11, 4096); r != 0 {
		t.Fatalf("cuMemsetD8: %d", r)
	}
	if r := raw.memsetD8(uintptr(b2), 0x5a, 4096); r != 0 {
		t.Fatalf("cuMemsetD8: %d", r)
	}
	if err := d.DeviceSynchronize(0); err != nil {
		t.Fatal(err)
	}
	bh, off, dev, err := a.IpcHandle(b2)
	if err != nil || dev != 0 || off == 0 {
		t.Fatalf("IpcHandle = offset %d, device %d, %v; want a non-zero offset on device 0", off, dev, err)
	}

	// A handle of memory freed since.
	stale, err := d.MemAlloc(0, 2<<20)
	if err != nil {
		t.Fatal(err)
	}
	sh, err := d.IpcGetMemHandle(0, stale)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.MemFree(0, stale); err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(os.Args[0], "-test.run=^TestGPUIpcHelper$", "-test.v")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s:%d:%s", ipcHelperEnv, hex.EncodeToString(bh[:]), off, hex.EncodeToString(sh[:])))
	out, err := cmd.CombinedOutput()
	t.Logf("helper process:\n%s", out)
	if err != nil {
		t.Fatalf("helper process: %v", err)
	}
	if !strings.Contains(string(out), "--- PASS: TestGPUIpcHelper") {
		t.Fatal("the helper process did not run its test")
	}
	for _, p := range []cuda.Ptr{b1, b2} {
		if err := a.Free(allocator.FreeRequest{Ptr: p}); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.EmptyCache(0); err != nil {
		t.Fatal(err)
	}
}

// TestGPUIpcHelper is TestGPUIpc's other process.
func TestGPUIpcHelper(t *testing.T) {
	arg := os.Getenv(ipcHelperEnv)
	if arg == "" {
		t.Skip("run by TestGPUIpc")
	}
	parts := strings.Split(arg, ":")
	var h, stale cuda.IpcHandle
	var off uint64
	if len(parts) != 3 || hexInto(h[:], parts[0]) != nil || hexInto(stale[:], parts[2]) != nil {
		t.Fatalf("bad %s %q", ipcHelperEnv, arg)
	}
	if _, err := fmt.Sscan(parts[1], &off); err != nil {
		t.Fatal(err)
	}
	d := openGPU(t)
	raw := openRaw(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	raw.pushPrimary(t)
	cfg, _, err := allocator.ParseConfig("")
	if err != nil {
		t.Fatal(err)
	}
	a, err := allocator.New(d, cfg)
	if err != nil {
		t.Fatal(err)
	}

	// Open and close during a global-mode capture, the thread in global
	// mode: the capture must survive (the simulator models this).
	var s uintptr
	if r := raw.streamCreate(&s, 1); r != 0 {
		t.Fatalf("cuStreamCreate: %d", r)
	}
	defer raw.streamDestroy(s)
	if r := raw.streamBeginCapture(s, 0); r != 0 {
		t.Fatalf("cuStreamBeginCapture_v2: %d", r)
	}
	q, err := a.IpcOpen(0, h)
	if err == nil {
		err = a.IpcClose(q)
	}
	var g uintptr
	if r := raw.streamEndCapture(s, &g); r != 0 {
		t.Errorf("cuStreamEndCapture: %d: IPC calls invalidated the capture", r)
	} else {
		raw.graphDestroy(g)
	}
	if err != nil {
		t.Fatalf("IpcOpen/IpcClose during capture: %v", err)
	}

	q, err = a.IpcOpen(0, h)
	if err != nil {
		t.Fatalf("IpcOpen: %v", err)
	}
	if q2, err := a.IpcOpen(0, h); err != nil || q2 != q {
		t.Fatalf("second IpcOpen = %#x, %v; want %#x", q2, err, q)
	}
	var got [4096]byte
	if r := raw.memcpyDtoH(&got[0], uintptr(q)+uintptr(off), uintptr(len(got))); r != 0 {
		t.Fatalf("cuMemcpyDtoH from the mapping: %d", r)
	}
	for i, b := range got {
		if b != 0x5a {
			t.Fatalf("byte %d of the shared block is %#x, want 0x5a", i, b)
		}
	}
	t.Logf("read the block at mapping %#x + %d", q, off)
	for i := 0; i < 2; i++ {
		if err := a.IpcClose(q); err != nil {
			t.Fatalf("IpcClose %d: %v", i+1, err)
		}
	}
	if r := raw.memcpyDtoH(&got[0], uintptr(q)+uintptr(off), 16); r == 0 {
		t.Error("the mapping is still readable after the last IpcClose")
	}
	if err := a.IpcClose(q); !errors.Is(err, allocator.ErrUnknownPointer) {
		t.Errorf("third IpcClose: %v", err)
	}
	if _, err := a.IpcOpen(0, stale); !errors.Is(err, allocator.ErrInvalidArgument) || !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("IpcOpen of a freed buffer's handle: %v", err)
	}
	if _, err := d.IpcOpenMemHandle(0, cuda.IpcHandle{}); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("IpcOpenMemHandle of a zero handle: %v", err)
	}
	if err := d.IpcCloseMemHandle(0, q); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("IpcCloseMemHandle of a closed mapping: %v", err)
	}
}

func hexInto(dst []byte, s string) error {
	b, err := hex.DecodeString(s)
	if err != nil {
		return err
	}
	if len(b) != len(dst) {
		return fmt.Errorf("%d bytes, want %d", len(b), len(dst))
	}
	copy(dst, b)
	return nil
}
