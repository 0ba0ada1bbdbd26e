// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package driver_test

import (
	"errors"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/ebitengine/purego"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/driver"
	"github.com/cudapool/cudapool/vmem"
)

// The real driver is what vmem's Copier consumes.
var _ vmem.CopyDriver = (*driver.Driver)(nil)

// copyProbes are the fake driver's counters for the copy engine.
type copyProbes struct {
	liveHost    func() int64
	liveStreams func() int64
	syncs       func() int64
	dtoh        func() int64
	htod        func() int64
	htodSum     func() uint64
	copied      func() uint64
	deviceByte  func(uint64) uint8
}

func openCopyProbes(t *testing.T) *copyProbes {
	t.Helper()
	h, err := purego.Dlopen(filepath.Join(buildFakes(t), "libfakecuda.so"), purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		t.Fatal(err)
	}
	p := &copyProbes{}
	for name, fn := range map[string]any{
		"fake_live_host":    &p.liveHost,
		"fake_live_streams": &p.liveStreams,
		"fake_stream_syncs": &p.syncs,
		"fake_dtoh_copies":  &p.dtoh,
		"fake_htod_copies":  &p.htod,
		"fake_htod_sum":     &p.htodSum,
		"fake_copied_bytes": &p.copied,
		"fake_device_byte":  &p.deviceByte,
	} {
		purego.RegisterLibFunc(fn, h, name)
	}
	return p
}

// The copy engine's calls reach the driver with the right arguments, in
// the named device's context, leave the thread's contexts as they were, and
// move the bytes they name.
func TestFakeCopyEngine(t *testing.T) {
	f := openFake(t)
	pr := openCopyProbes(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	host0, streams0, dtoh0, htod0, sum0 := pr.liveHost(), pr.liveStreams(), pr.dtoh(), pr.htod(), pr.htodSum()

	// Under device 0's context, work on device 1: each call pushes and pops.
	f.ctxPushCurrent(primary(0))
	defer func() {
		var c uintptr
		f.ctxPopCurrent(&c)
	}()

	const n = 1 << 16
	h, err := f.HostAlloc(1, n)
	if err != nil || h == 0 {
		t.Fatalf("HostAlloc = %#x, %v", h, err)
	}
	s, err := f.StreamCreate(1)
	if err != nil || s == 0 {
		t.Fatalf("StreamCreate = %#x, %v", s, err)
	}
	if pr.liveHost() != host0+1 || pr.liveStreams() != streams0+1 {
		t.Fatalf("live host allocations %d, streams %d", pr.liveHost()-host0, pr.liveStreams()-streams0)
	}

	// Device to host: the fake writes a function of each device address.
	const src = cuda.Ptr(0x7f0100012345)
	if err := f.MemcpyDtoHAsync(1, h+100, src, n-200, s); err != nil {
		t.Fatalf("MemcpyDtoHAsync: %v", err)
	}
	got := make([]byte, n)
	driver.HostRead(got, h)
	for i := 100; i < n-100; i++ {
		if want := pr.deviceByte(uint64(src) + uint64(i-100)); got[i] != want {
			t.Fatalf("host byte %d = %#x, want %#x (device %#x)", i, got[i], want, uint64(src)+uint64(i-100))
		}
	}

	// Host to device: the fake sums the bytes it read.
	buf := make([]byte, n)
	var sum uint64
	for i := range buf {
		buf[i] = byte(i*7 + 3)
		sum += uint64(buf[i])
	}
	driver.HostWrite(h, buf)
	if err := f.MemcpyHtoDAsync(1, 0x7f0100000000, h, n, s); err != nil {
		t.Fatalf("MemcpyHtoDAsync: %v", err)
	}
	if pr.htodSum()-sum0 != sum || pr.dtoh()-dtoh0 != 1 || pr.htod()-htod0 != 1 {
		t.Fatalf("copies: D2H %d, H2D %d, sum %d (want %d)", pr.dtoh()-dtoh0, pr.htod()-htod0, pr.htodSum()-sum0, sum)
	}
	syncs := pr.syncs()
	if err := f.StreamSynchronize(1, s); err != nil || pr.syncs() != syncs+1 {
		t.Fatalf("StreamSynchronize: %v (%d calls)", err, pr.syncs()-syncs)
	}

	// Misuse comes back as driver errors: memory that is not pinned, a
	// stream of another device (the fake checks the current context).
	if err := f.MemcpyDtoHAsync(1, h+n-10, src, 11, s); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("copy past the pinned allocation: %v", err)
	}
	if err := f.MemcpyDtoHAsync(0, h, src, 16, s); !errors.Is(err, cuda.ErrInvalidContext) {
		t.Errorf("copy on device 1's stream named as device 0's: %v", err)
	}
	if _, err := f.HostAlloc(2, 4096); !errors.Is(err, cuda.ErrInvalidDevice) {
		t.Errorf("HostAlloc on device 2: %v", err)
	}

	if err := f.StreamDestroy(1, s); err != nil {
		t.Fatalf("StreamDestroy: %v", err)
	}
	if err := f.HostFree(1, h); err != nil {
		t.Fatalf("HostFree: %v", err)
	}
	if err := f.HostFree(1, h); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("second HostFree: %v", err)
	}
	if pr.liveHost() != host0 || pr.liveStreams() != streams0 {
		t.Fatalf("after frees: %d host allocations, %d streams left", pr.liveHost()-host0, pr.liveStreams()-streams0)
	}
	if c, d := f.current(), f.depth(); c != primary(0) || d != 1 {
		t.Fatalf("context after the calls: %#x, depth %d", c, d)
	}
}

// A copy is one cgo call: no Go allocation.
func TestFakeCopyDoesNotAllocate(t *testing.T) {
	f := openFake(t)
	h, err := f.HostAlloc(0, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer f.HostFree(0, h)
	s, err := f.StreamCreate(0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.StreamDestroy(0, s)
	for name, fn := range map[string]func(){
		"MemcpyDtoHAsync":   func() { _ = f.MemcpyDtoHAsync(0, h, 0x7f0000000000, 64, s) },
		"MemcpyHtoDAsync":   func() { _ = f.MemcpyHtoDAsync(0, 0x7f0000000000, h, 64, s) },
		"StreamSynchronize": func() { _ = f.StreamSynchronize(0, s) },
	} {
		if n := testing.AllocsPerRun(100, fn); n != 0 {
			t.Errorf("%s: %v allocations per call", name, n)
		}
	}
}

// A driver that lacks one of the copy entry points opens, and the copy
// methods say the driver does not support them.
func TestFakeCopyMissingEntryPoint(t *testing.T) {
	buildFakes(t)
	lib := filepath.Join(t.TempDir(), "libfakecuda-nocopy.so")
	if out, err := exec.Command("gcc", "-Wall", "-O1", "-shared", "-fPIC", "-DFAKECUDA_NO_COPY", "-o", lib, "testdata/fakecuda.c").CombinedOutput(); err != nil {
		t.Fatalf("building the fake: %v\n%s", err, out)
	}
	d, err := driver.OpenLibrary(lib)
	if err != nil {
		t.Fatalf("OpenLibrary: %v", err)
	}
	defer d.Close()
	if _, err := d.HostAlloc(0, 4096); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("HostAlloc: %v", err)
	}
	if _, err := d.StreamCreate(0); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("StreamCreate: %v", err)
	}
	if err := d.MemcpyDtoHAsync(0, 0x1000, 0x7f0000000000, 64, 0); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("MemcpyDtoHAsync: %v", err)
	}
	if err := d.StreamSynchronize(0, 0); !errors.Is(err, cuda.ErrNotSupported) {
		t.Errorf("StreamSynchronize: %v", err)
	}
}
