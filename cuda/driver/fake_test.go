// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package driver_test

import (
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/ebitengine/purego"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/driver"
	"github.com/cudapool/cudapool/events"
)

// The real driver is what the allocator and the event layer consume, and it
// offers the allocator's optional process listing.
var (
	_ allocator.Driver = (*driver.Driver)(nil)
	_ events.Driver    = (*driver.Driver)(nil)
	_ interface {
		DeviceProcesses(dev int) ([]cuda.ProcessMemory, error)
	} = (*driver.Driver)(nil)
	_ interface {
		IpcGetMemHandle(dev int, p cuda.Ptr) (cuda.IpcHandle, error)
		IpcOpenMemHandle(dev int, h cuda.IpcHandle) (cuda.Ptr, error)
		IpcCloseMemHandle(dev int, p cuda.Ptr) error
	} = (*driver.Driver)(nil)
)

// fakeLibs builds testdata/fakecuda.c and fakenvml.c once per test binary.
// dir/libfakecuda.so is loaded in process by path (and two variants without
// some IPC entry points); dir/ld holds the same code as libcuda.so.1 and
// libnvidia-ml.so.1 for subprocesses that find them through LD_LIBRARY_PATH. (No SONAME, so loading libfakecuda.so in
// process never satisfies a later dlopen("libcuda.so.1").)
var fakeLibs struct {
	once sync.Once
	dir  string
	err  error
}

// TestMain removes the fake libraries after the tests.
func TestMain(m *testing.M) {
	code := m.Run()
	if fakeLibs.dir != "" {
		os.RemoveAll(fakeLibs.dir)
	}
	os.Exit(code)
}

func buildFakes(t testing.TB) string {
	t.Helper()
	fakeLibs.once.Do(func() {
		if _, err := exec.LookPath("gcc"); err != nil {
			fakeLibs.err = err
			return
		}
		dir, err := os.MkdirTemp("", "cudapool-fakes-")
		if err != nil {
			fakeLibs.err = err
			return
		}
		if err := os.Mkdir(filepath.Join(dir, "ld"), 0o755); err != nil {
			fakeLibs.err = err
			return
		}
		for _, b := range [][3]string{
			{"testdata/fakecuda.c", "libfakecuda.so", ""},
			{"testdata/fakecuda.c", "libfakecuda-noipc.so", "-DFAKECUDA_NO_IPC"},
			{"testdata/fakecuda.c", "libfakecuda-ipcv1.so", "-DFAKECUDA_IPC_V1"},
			{"testdata/fakecuda.c", "ld/libcuda.so.1", ""},
			{"testdata/fakenvml.c", "ld/libnvidia-ml.so.1", ""},
		} {
			args := []string{"-Wall", "-O1", "-shared", "-fPIC", "-o", filepath.Join(dir, b[1]), b[0]}
			if b[2] != "" {
				args = append(args, b[2])
			}
			out, err := exec.Command("gcc", args...).CombinedOutput()
			if err != nil {
				fakeLibs.err = errors.New(string(out))
				return
			}
		}
		fakeLibs.dir = dir
	})
	if fakeLibs.err != nil {
		t.Skipf("cannot build the fake driver libraries: %v", fakeLibs.err)
	}
	return fakeLibs.dir
}

// fake is a Driver over the fake libcuda plus its probes.
type fake struct {
	*driver.Driver
	pushes         func() int64
	retains        func(int32) int64
	liveAllocs     func() int64
	liveEvents     func() int64
	depth          func() int32
	captureMode    func() int32
	lastProcVer    func() int32
	setCapture     func(uintptr, uint64)
	setTerminals   func(*uintptr, uint64)
	graphQueries   func() int64
	ctxGetCurrent  func(*uintptr) int32
	ctxPushCurrent func(uintptr) int32
	ctxPopCurrent  func(*uintptr) int32
	liveHandles    func() int64
	liveReserves   func() int64
	mappedBytes    func() int64
	setAccessCalls func() int64
	lastAccessN    func() int64
	ipcMappings    func() int64
	ipcOpens       func() int64
	ipcV1Opens     func() int64
	fdExports      func() int64
	fabricExports  func() int64
	imports        func() int64
	handleAlloc    func(uint64) uint64
	handleKinds    func(uint64) int32
}

func openFake(t testing.TB) *fake {
	t.Helper()
	path := filepath.Join(buildFakes(t), "libfakecuda.so")
	d, err := driver.OpenLibrary(path)
	if err != nil {
		t.Fatalf("OpenLibrary(fake): %v", err)
	}
	t.Cleanup(func() { _ = d.Close() })
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Fatal(err)
	}
	f := &fake{Driver: d}
	for name, fn := range map[string]any{
		"fake_pushes":            &f.pushes,
		"fake_retains":           &f.retains,
		"fake_live_allocs":       &f.liveAllocs,
		"fake_live_events":       &f.liveEvents,
		"fake_depth":             &f.depth,
		"fake_capture_mode":      &f.captureMode,
		"fake_last_proc_version": &f.lastProcVer,
		"fake_set_capture":       &f.setCapture,
		"fake_set_terminals":     &f.setTerminals,
		"fake_graph_queries":     &f.graphQueries,
		"cuCtxGetCurrent":        &f.ctxGetCurrent,
		"cuCtxPushCurrent_v2":    &f.ctxPushCurrent,
		"cuCtxPopCurrent_v2":     &f.ctxPopCurrent,
		"fake_live_handles":      &f.liveHandles,
		"fake_live_reservations": &f.liveReserves,
		"fake_mapped_bytes":      &f.mappedBytes,
		"fake_set_access_calls":  &f.setAccessCalls,
		"fake_last_access_count": &f.lastAccessN,
		"fake_ipc_mappings":      &f.ipcMappings,
		"fake_ipc_opens":         &f.ipcOpens,
		"fake_ipc_v1_opens":      &f.ipcV1Opens,
		"fake_fd_exports":        &f.fdExports,
		"fake_fabric_exports":    &f.fabricExports,
		"fake_imports":           &f.imports,
		"fake_handle_alloc":      &f.handleAlloc,
		"fake_handle_kinds":      &f.handleKinds,
	} {
		purego.RegisterLibFunc(fn, h, name)
	}
	return f
}

func (f *fake) current() uintptr {
	var c uintptr
	f.ctxGetCurrent(&c)
	return c
}

func primary(dev int) uintptr { return uintptr(0x1000 + dev) }

func TestOpenMissingLibrary(t *testing.T) {
	_, err := driver.OpenLibrary("/nonexistent/libcuda.so.1")
	if err == nil {
		t.Fatal("OpenLibrary of a missing file succeeded")
	}
	const want = "cudapool: cannot load the CUDA driver (/nonexistent/libcuda.so.1): "
	if !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("error %q does not start with %q", err, want)
	}
}

func TestOpenWithoutDriver(t *testing.T) {
	if h, err := purego.Dlopen(driver.LibraryName, purego.RTLD_NOW|purego.RTLD_LOCAL); err == nil {
		_ = purego.Dlclose(h)
		t.Skip("libcuda.so.1 is installed here; the GPU tests cover Open")
	}
	d, err := driver.Open()
	if err == nil || d != nil {
		t.Fatalf("Open() = %v, %v without libcuda.so.1", d, err)
	}
	const want = "cudapool: cannot load the CUDA driver (libcuda.so.1): "
	if !strings.HasPrefix(err.Error(), want) {
		t.Fatalf("error %q does not start with %q", err, want)
	}
	t.Log(err)
}

func TestFakeOpen(t *testing.T) {
	f := openFake(t)
	if n, err := f.DeviceCount(); n != 2 || err != nil {
		t.Fatalf("DeviceCount = %d, %v; want 2", n, err)
	}
	if v := f.Version(); v != 13000 {
		t.Errorf("Version = %d", v)
	}
	if got := f.CaptureInfoEntryPoint(); !strings.HasPrefix(got, "cuGetProcAddress_v2(") {
		t.Errorf("capture info entry point %q, want it from cuGetProcAddress_v2", got)
	}
	if v := f.lastProcVer(); v != 12000 {
		t.Errorf("cuGetProcAddress_v2 asked for API version %d, want 12000", v)
	}
	if id, err := f.PCIBusID(1); id != "0000:3c:00.0" || err != nil {
		t.Errorf("PCIBusID(1) = %q, %v", id, err)
	}
}

func TestFakeCaptureInfoFallback(t *testing.T) {
	buildFakes(t)
	t.Setenv("FAKECUDA_NO_PROC_ADDRESS", "1")
	f := openFake(t)
	if got := f.CaptureInfoEntryPoint(); got != "cuStreamGetCaptureInfo_v2" {
		t.Fatalf("capture info entry point %q, want the dlsym fallback", got)
	}
	if st, id, err := f.StreamCaptureInfo(0, 0); st != cuda.CaptureNone || id != 0 || err != nil {
		t.Fatalf("StreamCaptureInfo = %v, %d, %v", st, id, err)
	}
}

func TestFakeInitError(t *testing.T) {
	dir := buildFakes(t)
	t.Setenv("FAKECUDA_INIT_ERROR", "100")
	_, err := driver.OpenLibrary(filepath.Join(dir, "libfakecuda.so"))
	if !errors.Is(err, cuda.ErrNoDevice) || !strings.Contains(err.Error(), "cuInit") {
		t.Fatalf("Open with cuInit failing: %v", err)
	}
}

func TestFakeInvalidDevice(t *testing.T) {
	f := openFake(t)
	for _, dev := range []int{-1, 2} {
		if _, err := f.MemAlloc(dev, 1024); !errors.Is(err, cuda.ErrInvalidDevice) {
			t.Errorf("MemAlloc(%d): %v", dev, err)
		}
		if _, err := f.EventQuery(dev, 1); !errors.Is(err, cuda.ErrInvalidDevice) {
			t.Errorf("EventQuery(%d): %v", dev, err)
		}
	}
}

// Every device method must work whatever context is current and leave the
// thread's context stack as it found it.
func TestFakeContextRestored(t *testing.T) {
	f := openFake(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	exercise := func(dev int) {
		t.Helper()
		p, err := f.MemAlloc(dev, 4096)
		if err != nil {
			t.Fatalf("MemAlloc(%d): %v", dev, err)
		}
		if err := f.MemFree(dev, p); err != nil {
			t.Fatalf("MemFree(%d): %v", dev, err)
		}
		if free, total, err := f.MemGetInfo(dev); err != nil || total != uint64(dev+1)<<34 || free >= total {
			t.Fatalf("MemGetInfo(%d) = %d, %d, %v", dev, free, total, err)
		}
		e, err := f.EventCreate(dev)
		if err != nil {
			t.Fatalf("EventCreate(%d): %v", dev, err)
		}
		if err := f.EventRecord(dev, e, 0); err != nil {
			t.Fatalf("EventRecord: %v", err)
		}
		if err := f.EventSynchronize(dev, e); err != nil {
			t.Fatalf("EventSynchronize: %v", err)
		}
		if err := f.EventDestroy(dev, e); err != nil {
			t.Fatalf("EventDestroy: %v", err)
		}
		if err := f.DeviceSynchronize(dev); err != nil {
			t.Fatalf("DeviceSynchronize: %v", err)
		}
		if _, _, err := f.StreamCaptureInfo(dev, 0); err != nil {
			t.Fatalf("StreamCaptureInfo: %v", err)
		}
	}

	// No context current.
	exercise(0)
	if c, d := f.current(), f.depth(); c != 0 || d != 0 {
		t.Fatalf("after calls with no context: current %#x, depth %d", c, d)
	}

	// Another device's primary context current: push/pop around each call.
	f.ctxPushCurrent(primary(1))
	before := f.pushes()
	exercise(0)
	if c, d := f.current(), f.depth(); c != primary(1) || d != 1 {
		t.Fatalf("after calls under device 1: current %#x, depth %d", c, d)
	}
	if f.pushes() == before {
		t.Fatal("device 0 calls under device 1's context pushed nothing")
	}

	// The device's own primary context current: no push needed.
	before = f.pushes()
	exercise(1)
	if got := f.pushes() - before; got != 0 {
		t.Errorf("%d pushes although the right context was current", got)
	}
	var popped uintptr
	f.ctxPopCurrent(&popped)
	if f.depth() != 0 {
		t.Fatal("context stack not empty")
	}
}

func TestFakeMemoryAndEvents(t *testing.T) {
	f := openFake(t)
	allocs := f.liveAllocs()
	p, err := f.MemAlloc(1, 1<<20)
	if err != nil || p == 0 {
		t.Fatalf("MemAlloc = %#x, %v", p, err)
	}
	if _, err := f.MemAlloc(0, 1<<40); !errors.Is(err, cuda.ErrOutOfMemory) {
		t.Errorf("huge MemAlloc: %v, want out of memory", err)
	}
	if _, err := f.MemAlloc(0, 0); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("MemAlloc(0 bytes): %v", err)
	}
	if err := f.MemFree(0, p); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("MemFree on the wrong device: %v (the fake rejects it)", err)
	}
	if err := f.MemFree(1, p); err != nil {
		t.Fatal(err)
	}
	if got := f.liveAllocs(); got != allocs {
		t.Errorf("live allocations %d, want %d", got, allocs)
	}

	evs := f.liveEvents()
	e, err := f.EventCreate(0) // the fake insists on CU_EVENT_DISABLE_TIMING
	if err != nil {
		t.Fatal(err)
	}
	if err := f.EventRecord(0, e, 0); err != nil {
		t.Fatal(err)
	}
	for i, want := range []bool{false, false, true} {
		done, err := f.EventQuery(0, e)
		if done != want || err != nil {
			t.Fatalf("query %d: %v, %v; want %v, nil (not ready is not an error)", i, done, err, want)
		}
	}
	if _, err := f.EventQuery(1, e); !errors.Is(err, cuda.ErrInvalidContext) {
		t.Errorf("EventQuery with the wrong device: %v", err)
	}
	if err := f.EventDestroy(0, e); err != nil {
		t.Fatal(err)
	}
	if got := f.liveEvents(); got != evs {
		t.Errorf("live events %d, want %d", got, evs)
	}
}

func TestFakeCapture(t *testing.T) {
	f := openFake(t)
	runtime.LockOSThread() // the capture mode is per OS thread
	defer runtime.UnlockOSThread()

	const s = cuda.Stream(0xcafe)
	f.setCapture(uintptr(s), 42)
	defer f.setCapture(0, 0)

	if st, id, err := f.StreamCaptureInfo(0, s); st != cuda.CaptureActive || id != 42 || err != nil {
		t.Fatalf("capturing stream: %v, %d, %v", st, id, err)
	}
	if st, id, err := f.StreamCaptureInfo(0, 0); st != cuda.CaptureNone || id != 0 || err != nil {
		t.Fatalf("other stream: %v, %d, %v", st, id, err)
	}

	if n := f.graphQueries(); n != 0 {
		t.Errorf("StreamCaptureInfo asked for the capture graph (%d queries)", n)
	}

	if _, err := f.MemAlloc(0, 4096); !errors.Is(err, cuda.ErrCaptureUnsupported) {
		t.Fatalf("MemAlloc during a global-mode capture: %v", err)
	}
	prev, err := f.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
	if err != nil || prev != cuda.CaptureModeGlobal {
		t.Fatalf("ExchangeCaptureMode = %v, %v", prev, err)
	}
	p, err := f.MemAlloc(0, 4096)
	if err != nil {
		t.Fatalf("MemAlloc in relaxed mode: %v", err)
	}
	if prev, err := f.ExchangeCaptureMode(prev); err != nil || prev != cuda.CaptureModeRelaxed {
		t.Fatalf("exchange back = %v, %v", prev, err)
	}
	if err := f.MemFree(0, p); err != nil {
		t.Fatal(err)
	}

	f.ExchangeCaptureMode(cuda.CaptureModeThreadLocal)
	p, err = f.MemAllocRelaxed(0, 4096)
	if err != nil {
		t.Fatalf("MemAllocRelaxed: %v", err)
	}
	if m := f.captureMode(); m != int32(cuda.CaptureModeThreadLocal) {
		t.Errorf("MemAllocRelaxed left the thread in mode %d", m)
	}
	f.ExchangeCaptureMode(cuda.CaptureModeGlobal)
	if err := f.MemFree(0, p); err != nil {
		t.Fatal(err)
	}
}

// The malloc/free path must not allocate Go memory.
func TestFakeHotPathDoesNotAllocate(t *testing.T) {
	f := openFake(t)
	e, err := f.EventCreate(0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.EventDestroy(0, e)
	for name, fn := range map[string]func(){
		"EventRecord":       func() { _ = f.EventRecord(0, e, 0) },
		"EventQuery":        func() { _, _ = f.EventQuery(0, e) },
		"StreamCaptureInfo": func() { _, _, _ = f.StreamCaptureInfo(0, 0x1234) },
		"ExchangeCaptureMode": func() {
			runtime.LockOSThread()
			m, _ := f.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
			_, _ = f.ExchangeCaptureMode(m)
			runtime.UnlockOSThread()
		},
		"MemAlloc+MemFree": func() {
			p, _ := f.MemAlloc(1, 512)
			_ = f.MemFree(1, p)
		},
		"MemAllocRelaxed+MemFree": func() {
			p, _ := f.MemAllocRelaxed(1, 512)
			_ = f.MemFree(1, p)
		},
	} {
		if n := testing.AllocsPerRun(1000, fn); n != 0 {
			t.Errorf("%s: %v allocations per call", name, n)
		}
	}
}

func TestFakeClose(t *testing.T) {
	f := openFake(t)
	before := f.retains(0)
	if _, err := f.MemAlloc(0, 512); err != nil {
		t.Fatal(err)
	}
	if got := f.retains(0); got != before+1 {
		t.Fatalf("retains %d, want %d (one per Driver and device)", got, before+1)
	}
	f.MemAlloc(0, 512)
	if got := f.retains(0); got != before+1 {
		t.Fatalf("retains %d after a second call, want %d", got, before+1)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if got := f.retains(0); got != before {
		t.Fatalf("retains %d after Close, want %d", got, before)
	}
}

func BenchmarkFakeEventQuery(b *testing.B) {
	f := openFake(b)
	e, _ := f.EventCreate(0)
	b.ReportAllocs()
	for b.Loop() {
		f.EventQuery(0, e)
	}
}

func BenchmarkFakeStreamCaptureInfo(b *testing.B) {
	f := openFake(b)
	b.ReportAllocs()
	for b.Loop() {
		f.StreamCaptureInfo(0, 0x1234)
	}
}

// The VMM calls pass the structs cuda.h defines (the fake checks their
// layout and contents), name the right device and leave the thread's
// context as they found it.
func TestFakeVMM(t *testing.T) {
	f := openFake(t)
	const gran = 2 << 20
	g, err := f.MemGranularity(1)
	if err != nil || g != gran {
		t.Fatalf("MemGranularity = %d, %v", g, err)
	}
	handles, reserves, mapped, access := f.liveHandles(), f.liveReserves(), f.mappedBytes(), f.setAccessCalls()
	base, err := f.MemAddressReserve(1, 8*gran)
	if err != nil || base == 0 {
		t.Fatalf("MemAddressReserve = %#x, %v", base, err)
	}
	if _, err := f.MemAddressReserve(1, gran+1); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("MemAddressReserve of a partial granule: %v", err)
	}
	var hs []cuda.MemHandle
	for i := 0; i < 2; i++ {
		h, err := f.MemCreate(1, gran)
		if err != nil || h == 0 {
			t.Fatalf("MemCreate = %d, %v", h, err)
		}
		if err := f.MemMap(1, base+cuda.Ptr(i*gran), gran, h); err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	if err := f.MemSetAccess(1, base, 2*gran); err != nil {
		t.Fatal(err)
	}
	if n := f.lastAccessN(); n != 2 {
		t.Errorf("cuMemSetAccess got %d descriptors, want 2 (the device and its peer)", n)
	}
	if got := f.depth(); got != 0 {
		t.Errorf("context stack depth %d after the calls, want 0", got)
	}
	if f.liveHandles()-handles != 2 || f.mappedBytes()-mapped != 2*gran || f.liveReserves()-reserves != 1 || f.setAccessCalls()-access != 1 {
		t.Errorf("handles %d, mapped %d, reservations %d, access calls %d", f.liveHandles()-handles, f.mappedBytes()-mapped, f.liveReserves()-reserves, f.setAccessCalls()-access)
	}
	for i, h := range hs {
		if err := f.MemUnmap(1, base+cuda.Ptr(i*gran), gran); err != nil {
			t.Fatal(err)
		}
		if err := f.MemRelease(1, h); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.MemAddressFree(1, base, 8*gran); err != nil {
		t.Fatal(err)
	}
	if f.liveHandles() != handles || f.mappedBytes() != mapped || f.liveReserves() != reserves {
		t.Errorf("left behind: handles %d, mapped %d, reservations %d", f.liveHandles()-handles, f.mappedBytes()-mapped, f.liveReserves()-reserves)
	}

	// Creating obeys the capture mode, like cuMemAlloc.
	f.setCapture(9, 1)
	if _, err := f.MemCreate(0, gran); !errors.Is(err, cuda.ErrCaptureUnsupported) {
		t.Errorf("MemCreate in global mode during capture: %v", err)
	}
	f.setCapture(0, 0)

	// A device without VMM support: the allocator falls back.
	t.Setenv("FAKECUDA_NO_VMM", "1")
	if _, err := f.MemGranularity(0); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("MemGranularity without VMM support: %v", err)
	}
}

// The allocator runs expandable segments over the fake driver.
func TestFakeAllocatorExpandable(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	f := openFake(t)
	cfg, _, err := allocator.ParseConfig("expandable_segments:True,expandable_map_unit_mb:2") // page by page
	if err != nil {
		t.Fatal(err)
	}
	a, err := allocator.New(f.Driver, cfg)
	if err != nil {
		t.Fatal(err)
	}
	a.SetWarningHandler(func(msg string) { t.Errorf("warning: %s", msg) })
	allocs, mapped, reserves, handles := f.liveAllocs(), f.mappedBytes(), f.liveReserves(), f.liveHandles()
	p, err := a.Malloc(&allocator.MallocRequest{Size: 3 << 20})
	if err != nil {
		t.Fatal(err)
	}
	q, err := a.Malloc(&allocator.MallocRequest{Size: 3 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if q != p+3<<20 || f.liveAllocs() != allocs || f.mappedBytes()-mapped != 6<<20 {
		t.Errorf("p %#x q %#x, cuMemAlloc'd %d, mapped %d", p, q, f.liveAllocs()-allocs, f.mappedBytes()-mapped)
	}
	for _, x := range []cuda.Ptr{p, q} {
		if err := a.Free(allocator.FreeRequest{Ptr: x}); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.EmptyCache(0); err != nil {
		t.Fatal(err)
	}
	if f.mappedBytes() != mapped || f.liveReserves() != reserves || f.liveHandles() != handles {
		t.Errorf("after empty_cache: mapped %d, reservations %d, handles %d", f.mappedBytes()-mapped, f.liveReserves()-reserves, f.liveHandles()-handles)
	}
	if err := a.CheckInvariants(); err != nil {
		t.Fatal(err)
	}
}

// fakeHandle is the fake libcuda's CUipcMemHandle (testdata/fakecuda.c).
type fakeHandle struct {
	magic              string
	dev                int32
	base, size, serial uint64
}

func decodeFake(t *testing.T, h cuda.IpcHandle) fakeHandle {
	t.Helper()
	le := binary.LittleEndian
	f := fakeHandle{
		magic:  string(h[:8]),
		dev:    int32(le.Uint32(h[8:])),
		base:   le.Uint64(h[16:]),
		size:   le.Uint64(h[24:]),
		serial: le.Uint64(h[32:]),
	}
	if f.magic != "FAKEIPC\x00" || le.Uint32(h[12:]) != 0 || f.serial == 0 {
		t.Fatalf("not a handle of the fake: % x", h)
	}
	return f
}

// The IPC calls name the right device's context, pass CUipcMemHandle's 64
// bytes intact both ways (the fake checks every byte of what it receives),
// use cuIpcOpenMemHandle_v2 with CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (the
// fake refuses other flags) and restore the thread's context.
func TestFakeIPC(t *testing.T) {
	f := openFake(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if got := f.IpcEntryPoint(); got != "cuIpcOpenMemHandle_v2" {
		t.Fatalf("IPC open entry point %q, want cuIpcOpenMemHandle_v2", got)
	}
	p, err := f.MemAlloc(1, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	h, err := f.IpcGetMemHandle(1, p+4096)
	if err != nil {
		t.Fatalf("IpcGetMemHandle inside an allocation: %v", err)
	}
	if fh := decodeFake(t, h); fh.dev != 1 || fh.base != uint64(p) || fh.size != 1<<20 {
		t.Fatalf("handle names device %d, %#x (%d bytes); want device 1, %#x (1 MiB)", fh.dev, fh.base, fh.size, p)
	}
	if h2, err := f.IpcGetMemHandle(1, p); err != nil || h2 != h {
		t.Fatalf("IpcGetMemHandle of the base = %v; want the same handle", err)
	}
	if _, err := f.IpcGetMemHandle(0, p); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("IpcGetMemHandle naming the wrong device: %v", err)
	}
	if _, err := f.IpcGetMemHandle(1, p+1<<20); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("IpcGetMemHandle past the allocation: %v", err)
	}
	if _, err := f.IpcGetMemHandle(2, p); !errors.Is(err, cuda.ErrInvalidDevice) {
		t.Errorf("IpcGetMemHandle on device 2: %v", err)
	}

	// Open on device 0 while device 1's context is current.
	f.ctxPushCurrent(primary(1))
	mappings, opens := f.ipcMappings(), f.ipcOpens()
	q, err := f.IpcOpenMemHandle(0, h)
	if err != nil || q == 0 {
		t.Fatalf("IpcOpenMemHandle = %#x, %v", q, err)
	}
	if c, d := f.current(), f.depth(); c != primary(1) || d != 1 {
		t.Fatalf("after IpcOpenMemHandle: current %#x, depth %d", c, d)
	}
	if q2, err := f.IpcOpenMemHandle(0, h); err != nil || q2 != q {
		t.Fatalf("second open = %#x, %v; want %#x (the driver counts references)", q2, err, q)
	}
	if got := f.ipcMappings() - mappings; got != 1 {
		t.Errorf("%d new mappings, want 1", got)
	}
	if got := f.ipcOpens() - opens; got != 2 {
		t.Errorf("%d opens, want 2", got)
	}
	if f.ipcV1Opens() != 0 {
		t.Error("the original cuIpcOpenMemHandle was called")
	}
	if err := f.IpcCloseMemHandle(1, q); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("IpcCloseMemHandle in the wrong context: %v", err)
	}
	if err := f.IpcCloseMemHandle(0, q+4096); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("IpcCloseMemHandle inside the mapping: %v", err)
	}
	for i := 0; i < 2; i++ {
		if err := f.IpcCloseMemHandle(0, q); err != nil {
			t.Fatalf("close %d: %v", i+1, err)
		}
	}
	if got := f.ipcMappings(); got != mappings {
		t.Errorf("%d mappings left", got-mappings)
	}
	if err := f.IpcCloseMemHandle(0, q); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("third close: %v", err)
	}
	var popped uintptr
	f.ctxPopCurrent(&popped)
	if f.depth() != 0 {
		t.Fatal("context stack not empty")
	}

	// Handles that are not, or no longer, handles.
	for name, x := range map[string]cuda.IpcHandle{
		"zero":    {},
		"garbage": func() cuda.IpcHandle { x := h; x[63] = 1; return x }(),
	} {
		if _, err := f.IpcOpenMemHandle(0, x); !errors.Is(err, cuda.ErrInvalidValue) {
			t.Errorf("open of a %s handle: %v", name, err)
		}
	}
	if err := f.MemFree(1, p); err != nil {
		t.Fatal(err)
	}
	if _, err := f.IpcOpenMemHandle(0, h); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("open of a freed allocation's handle: %v", err)
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = f.IpcGetMemHandle(0, 0x10) }); n != 0 {
		t.Errorf("IpcGetMemHandle: %v allocations per call", n)
	}
}

// Drivers without cuIpcOpenMemHandle_v2 use the original; drivers without
// IPC say ErrNotSupported.
func TestFakeIPCEntryPoints(t *testing.T) {
	dir := buildFakes(t)
	d, err := driver.OpenLibrary(filepath.Join(dir, "libfakecuda-ipcv1.so"))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if got := d.IpcEntryPoint(); got != "cuIpcOpenMemHandle" {
		t.Fatalf("entry point %q, want cuIpcOpenMemHandle", got)
	}
	p, err := d.MemAlloc(0, 4096)
	if err != nil {
		t.Fatal(err)
	}
	h, err := d.IpcGetMemHandle(0, p)
	if err != nil {
		t.Fatal(err)
	}
	q, err := d.IpcOpenMemHandle(0, h)
	if err != nil {
		t.Fatalf("open through cuIpcOpenMemHandle: %v", err)
	}
	if err := d.IpcCloseMemHandle(0, q); err != nil {
		t.Fatal(err)
	}
	if err := d.MemFree(0, p); err != nil {
		t.Fatal(err)
	}

	n, err := driver.OpenLibrary(filepath.Join(dir, "libfakecuda-noipc.so"))
	if err != nil {
		t.Fatalf("a driver without IPC must still open: %v", err)
	}
	defer n.Close()
	if got := n.IpcEntryPoint(); got != "" {
		t.Errorf("entry point %q without IPC", got)
	}
	if _, err := n.IpcGetMemHandle(0, p); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("IpcGetMemHandle: %v", err)
	}
	if _, err := n.IpcOpenMemHandle(0, h); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("IpcOpenMemHandle: %v", err)
	}
	if err := n.IpcCloseMemHandle(0, q); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("IpcCloseMemHandle: %v", err)
	}
	// Nor the sharing calls: the driver says so, and MemCreate still works.
	if _, err := n.ShareableKinds(0); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("ShareableKinds without the entry points: %v", err)
	}
	if _, err := n.MemExportShareable(0, 1, cuda.ShareablePOSIXFD); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("MemExportShareable without the entry points: %v", err)
	}
	if _, err := n.MemImportShareable(0, cuda.ShareableHandle{Kind: cuda.ShareablePOSIXFD, FD: 0}); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("MemImportShareable without the entry points: %v", err)
	}
	if err := n.ProbeFabric(0); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("ProbeFabric without the entry points: %v", err)
	}
	h0, err := n.MemCreate(0, 2<<20)
	if err != nil {
		t.Fatalf("MemCreate without the sharing calls: %v", err)
	}
	if err := n.MemRelease(0, h0); err != nil {
		t.Fatal(err)
	}
}

// The allocator shares a block through the real driver's code: the handle
// names the block's segment (a cuMemAlloc allocation) and the offset
// places the block in it; opening twice maps once.
func TestFakeAllocatorIPC(t *testing.T) {
	f := openFake(t)
	cfg, _, err := allocator.ParseConfig("expandable_segments:False") // cuMemAlloc'd segments
	if err != nil {
		t.Fatal(err)
	}
	a, err := allocator.New(f.Driver, cfg)
	if err != nil {
		t.Fatal(err)
	}
	a.ExpectAnnouncements()
	p1, err := a.Malloc(&allocator.MallocRequest{Dev: 1, Size: 4096})
	if err != nil {
		t.Fatal(err)
	}
	p2, err := a.Malloc(&allocator.MallocRequest{Dev: 1, Size: 4096})
	if err != nil {
		t.Fatal(err)
	}
	h, off, dev, err := a.IpcHandle(p2)
	if err != nil {
		t.Fatal(err)
	}
	base, size, err := a.BaseAllocation(p2)
	if err != nil {
		t.Fatal(err)
	}
	fh := decodeFake(t, h)
	if dev != 1 || fh.dev != 1 || fh.base != uint64(base) || fh.size != size || off != uint64(p2-base) || off == 0 {
		t.Fatalf("handle of device %d segment %#x (%d bytes), offset %d, dev %d; want segment %#x (%d bytes), offset %d",
			fh.dev, fh.base, fh.size, off, dev, base, size, p2-base)
	}
	mappings, opens := f.ipcMappings(), f.ipcOpens()
	q, err := a.IpcOpen(0, h)
	if err != nil {
		t.Fatal(err)
	}
	if q2, err := a.IpcOpen(0, h); err != nil || q2 != q {
		t.Fatalf("second IpcOpen = %#x, %v", q2, err)
	}
	if f.ipcOpens()-opens != 1 || f.ipcMappings()-mappings != 1 {
		t.Errorf("%d driver opens, %d mappings; want 1 and 1", f.ipcOpens()-opens, f.ipcMappings()-mappings)
	}
	for i := 0; i < 2; i++ {
		if err := a.IpcClose(q); err != nil {
			t.Fatal(err)
		}
	}
	if f.ipcMappings() != mappings {
		t.Error("mapping left open")
	}
	if err := a.IpcClose(q); !errors.Is(err, allocator.ErrUnknownPointer) {
		t.Errorf("third IpcClose: %v", err)
	}
	for _, p := range []cuda.Ptr{p1, p2} {
		if err := a.Free(allocator.FreeRequest{Dev: 1, Ptr: p}); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.EmptyCache(0); err != nil {
		t.Fatal(err)
	}
}

// StreamCaptureGraph and GraphNodeDependencies copy what the driver returns,
// growing the caller's buffer past their first guesses (8 terminals, 4
// dependencies), and keep the capture id apart from the terminals.
func TestFakeCaptureGraph(t *testing.T) {
	f := openFake(t)
	const s = cuda.Stream(0xcafe)
	f.setCapture(uintptr(s), 42)
	defer f.setCapture(0, 0)
	for _, n := range []int{0, 1, 8, 9, 20} {
		terms := make([]uintptr, n)
		for i := range terms {
			terms[i] = uintptr(0x1000 + 8*i + 7)
		}
		if n > 0 {
			f.setTerminals(&terms[0], uint64(n))
		} else {
			f.setTerminals(nil, 0)
		}
		buf := []cuda.GraphNode{99} // what the caller already had stays
		st, id, got, err := f.StreamCaptureGraph(0, s, buf)
		if err != nil || st != cuda.CaptureActive || id != 42 {
			t.Fatalf("%d terminals: status %v id %d err %v", n, st, id, err)
		}
		if len(got) != n+1 || got[0] != 99 {
			t.Fatalf("%d terminals: got %v", n, got)
		}
		for i, v := range terms {
			if got[1+i] != cuda.GraphNode(v) {
				t.Fatalf("%d terminals: terminal %d is %#x, want %#x", n, i, got[1+i], v)
			}
		}
		deps, err := f.GraphNodeDependencies(0, cuda.GraphNode(0x1007), nil)
		if err != nil || len(deps) != 7 || deps[0] != 0x10071 || deps[6] != 0x10077 {
			t.Fatalf("dependencies of 0x1007: %v %v", deps, err)
		}
	}
	if st, id, got, err := f.StreamCaptureGraph(0, 1, nil); st != cuda.CaptureNone || id != 0 || len(got) != 0 || err != nil {
		t.Fatalf("stream not capturing: %v %d %v %v", st, id, got, err)
	}
}
