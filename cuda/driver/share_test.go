// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package driver_test

import (
	"errors"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/driver"
	"github.com/cudapool/cudapool/vmem"
)

// The import cache runs over the real driver.
var _ vmem.ImportDriver = (*driver.Driver)(nil)

// The driver offers what an importer of shared physical memory needs.
var _ interface {
	MemCreateShareable(dev int, size uint64, kinds cuda.ShareableKind) (cuda.MemHandle, error)
	MemExportShareable(dev int, h cuda.MemHandle, kind cuda.ShareableKind) (cuda.ShareableHandle, error)
	MemImportShareable(dev int, sh cuda.ShareableHandle) (cuda.MemHandle, error)
	PidfdOpen(pid int) (int, error)
	PidfdGetfd(pidfd, pid, fd int) (int, error)
	CloseFD(fd int) error
} = (*fake)(nil)

// skipWithoutPidfd skips when this kernel or sandbox refuses pidfd_getfd on
// this very process (which ptrace rules always allow).
func skipWithoutPidfd(t *testing.T, f *fake) {
	t.Helper()
	pfd, err := f.PidfdOpen(os.Getpid())
	if err != nil {
		t.Skipf("pidfd_open unavailable here: %v", err)
	}
	defer f.CloseFD(pfd)
	fd, err := f.PidfdGetfd(pfd, os.Getpid(), 0)
	if err != nil {
		t.Skipf("pidfd_getfd unavailable here: %v", err)
	}
	f.CloseFD(fd)
}

// Memory created with a POSIX file descriptor handle is exported as a real
// descriptor, which pidfd_getfd duplicates and cuMemImportFromShareableHandle
// turns into a handle of the same allocation, mappable like any other; the
// kinds reach cuMemCreate's requestedHandleTypes.
func TestFakeShareablePOSIXFD(t *testing.T) {
	f := openFake(t)
	skipWithoutPidfd(t, f)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const gran = 2 << 20
	if k, err := f.ShareableKinds(1); err != nil || k != cuda.ShareablePOSIXFD|cuda.ShareableFabric {
		t.Fatalf("ShareableKinds = %v, %v", k, err)
	}
	handles, fdExports, imports := f.liveHandles(), f.fdExports(), f.imports()
	h, err := f.MemCreateShareable(1, gran, cuda.ShareablePOSIXFD)
	if err != nil {
		t.Fatal(err)
	}
	if k := f.handleKinds(uint64(h)); k != 1 {
		t.Fatalf("cuMemCreate got requestedHandleTypes %d, want 1", k)
	}
	if _, err := f.MemExportShareable(1, h, cuda.ShareableFabric); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("fabric export of memory created for file descriptors: %v", err)
	}
	sh, err := f.MemExportShareable(1, h, cuda.ShareablePOSIXFD)
	if err != nil || sh.Kind != cuda.ShareablePOSIXFD || sh.FD < 0 {
		t.Fatalf("MemExportShareable = %+v, %v", sh, err)
	}
	if f.fdExports()-fdExports != 1 {
		t.Error("the export did not reach the driver")
	}

	// The importer's side, played by this same process.
	pid := os.Getpid()
	pfd, err := f.PidfdOpen(pid)
	if err != nil {
		t.Fatal(err)
	}
	mine, err := f.PidfdGetfd(pfd, pid, sh.FD)
	if err != nil {
		t.Fatal(err)
	}
	if mine == sh.FD {
		t.Fatalf("pidfd_getfd returned the same descriptor %d", mine)
	}
	imp, err := f.MemImportShareable(0, cuda.ShareableHandle{Kind: cuda.ShareablePOSIXFD, FD: mine})
	if err != nil {
		t.Fatalf("MemImportShareable: %v", err)
	}
	if a, b := f.handleAlloc(uint64(imp)), f.handleAlloc(uint64(h)); a == 0 || a != b || imp == h {
		t.Fatalf("imported handle %d names allocation %d, exported handle %d names %d", imp, a, h, b)
	}
	for _, fd := range []int{mine, pfd, sh.FD} {
		if err := f.CloseFD(fd); err != nil {
			t.Fatal(err)
		}
	}
	// The imported handle outlives the descriptors and maps like any other.
	base, err := f.MemAddressReserve(0, gran)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.MemMap(0, base, gran, imp); err != nil {
		t.Fatalf("MemMap of the imported handle: %v", err)
	}
	if err := f.MemSetAccess(0, base, gran); err != nil {
		t.Fatal(err)
	}
	if err := f.MemUnmap(0, base, gran); err != nil {
		t.Fatal(err)
	}
	if err := f.MemAddressFree(0, base, gran); err != nil {
		t.Fatal(err)
	}
	for _, x := range []cuda.MemHandle{imp, h} {
		if err := f.MemRelease(0, x); err != nil {
			t.Fatal(err)
		}
	}
	if f.liveHandles() != handles || f.imports()-imports != 1 {
		t.Errorf("handles left %d, imports %d", f.liveHandles()-handles, f.imports()-imports)
	}
	if got := f.depth(); got != 0 {
		t.Errorf("context stack depth %d", got)
	}

	// Imports need a descriptor of a live export.
	if _, err := f.MemImportShareable(0, cuda.ShareableHandle{Kind: cuda.ShareablePOSIXFD, FD: 0}); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("import of stdin: %v", err)
	}
	if _, err := f.MemImportShareable(0, cuda.ShareableHandle{Kind: cuda.ShareablePOSIXFD, FD: -1}); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("import of descriptor -1: %v", err)
	}
	if _, err := f.MemImportShareable(0, cuda.ShareableHandle{Kind: 2}); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("import of an unknown kind: %v", err)
	}
	if _, err := f.MemCreateShareable(0, gran, 2); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("MemCreateShareable with a Win32 kind: %v", err)
	}
	if n := f.liveHandles(); n != handles {
		t.Errorf("%d handles leaked by refusals", n-handles)
	}
}

// A fabric handle carries its 64 bytes both ways intact (the fake checks
// every byte) and imports as the same allocation.
func TestFakeShareableFabric(t *testing.T) {
	f := openFake(t)
	const gran = 2 << 20
	h, err := f.MemCreateShareable(0, gran, cuda.ShareablePOSIXFD|cuda.ShareableFabric)
	if err != nil {
		t.Fatal(err)
	}
	defer f.MemRelease(0, h)
	if k := f.handleKinds(uint64(h)); k != 9 {
		t.Fatalf("requestedHandleTypes %d, want 9", k)
	}
	sh, err := f.MemExportShareable(0, h, cuda.ShareableFabric)
	if err != nil || sh.Kind != cuda.ShareableFabric || string(sh.Fabric[:8]) != "FAKEFAB\x00" {
		t.Fatalf("MemExportShareable = %+v, %v", sh, err)
	}
	imp, err := f.MemImportShareable(1, sh)
	if err != nil {
		t.Fatal(err)
	}
	if a := f.handleAlloc(uint64(imp)); a == 0 || a != f.handleAlloc(uint64(h)) {
		t.Fatalf("imported allocation %d, exported %d", a, f.handleAlloc(uint64(h)))
	}
	if err := f.MemRelease(1, imp); err != nil {
		t.Fatal(err)
	}
	bad := sh
	bad.Fabric[63] = 1
	if _, err := f.MemImportShareable(1, bad); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Errorf("import of a corrupted fabric handle: %v", err)
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = f.MemExportShareable(0, h, cuda.ShareableFabric) }); n != 0 {
		t.Errorf("MemExportShareable: %v allocations per call", n)
	}
}

// ProbeFabric does what PyTorch's get_fabric_access does: create, export,
// import. Each way fabric can be missing gives an error naming the step,
// and the probe leaks nothing.
func TestFakeProbeFabric(t *testing.T) {
	buildFakes(t)
	for _, c := range []struct {
		env, want string
		kinds     cuda.ShareableKind
	}{
		{"", "", cuda.ShareablePOSIXFD | cuda.ShareableFabric},
		{"FAKECUDA_NO_FABRIC", "does not support fabric handles", cuda.ShareablePOSIXFD},
		{"FAKECUDA_FABRIC_EXPORT_FAILS", "cuMemExportToShareableHandle (fabric)", cuda.ShareablePOSIXFD | cuda.ShareableFabric},
	} {
		t.Run(c.env, func(t *testing.T) {
			if c.env != "" {
				t.Setenv(c.env, "1")
			}
			f := openFake(t)
			handles := f.liveHandles()
			if k, err := f.ShareableKinds(0); err != nil || k != c.kinds {
				t.Errorf("ShareableKinds = %v, %v; want %v", k, err, c.kinds)
			}
			err := f.ProbeFabric(0)
			if c.want == "" && err != nil {
				t.Fatalf("ProbeFabric: %v", err)
			}
			if c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
				t.Fatalf("ProbeFabric = %v, want an error with %q", err, c.want)
			}
			if n := f.liveHandles(); n != handles {
				t.Errorf("the probe left %d handles", n-handles)
			}
		})
	}
	// cuMemCreate refuses fabric without the system's support, as drivers
	// do without an IMEX channel.
	t.Setenv("FAKECUDA_NO_FABRIC", "1")
	f := openFake(t)
	if _, err := f.MemCreateShareable(0, 2<<20, cuda.ShareableFabric); !errors.Is(err, cuda.ErrNotPermitted) {
		t.Errorf("MemCreateShareable(fabric) without fabric: %v", err)
	}
}

// pidfd_open and pidfd_getfd fail with errors that say what is wrong, and
// never block.
func TestPidfdErrors(t *testing.T) {
	f := openFake(t)
	skipWithoutPidfd(t, f)
	// A process that has exited and been reaped.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Skipf("cannot run true: %v", err)
	}
	gone := cmd.Process.Pid
	_, err := f.PidfdOpen(gone)
	var pe *cuda.PidfdError
	if !errors.As(err, &pe) || !errors.Is(err, syscall.ESRCH) || !strings.Contains(err.Error(), "has exited") {
		t.Errorf("PidfdOpen of an exited process: %v", err)
	}
	if _, err := f.PidfdOpen(0); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("PidfdOpen(0): %v", err)
	}
	// A descriptor the other process does not have.
	pid := os.Getpid()
	pfd, err := f.PidfdOpen(pid)
	if err != nil {
		t.Fatal(err)
	}
	defer f.CloseFD(pfd)
	_, err = f.PidfdGetfd(pfd, pid, 1<<20)
	if !errors.Is(err, syscall.EBADF) || !strings.Contains(err.Error(), "is not open in process") {
		t.Errorf("PidfdGetfd of a closed descriptor: %v", err)
	}
	// Not a pidfd at all.
	if _, err := f.PidfdGetfd(0, pid, 1); err == nil {
		t.Error("PidfdGetfd through stdin succeeded")
	}
	if err := f.CloseFD(-1); err == nil {
		t.Error("CloseFD(-1) succeeded")
	}
}

// PyTorch's handle, through the import cache, over the real driver's code
// and the real system calls: this process exports two allocations as
// descriptors, encodes the handle, and imports it as another process
// would (pidfd_getfd works on oneself); the mapping and everything the
// import took go with the release.
func TestFakeImportCacheEndToEnd(t *testing.T) {
	f := openFake(t)
	skipWithoutPidfd(t, f)
	const gran = 2 << 20
	handles, reserves, mapped := f.liveHandles(), f.liveReserves(), f.mappedBytes()
	s := vmem.SegmentShare{PID: int32(os.Getpid()), SegmentSize: gran, Kind: cuda.ShareablePOSIXFD}
	var hs []cuda.MemHandle
	for range 2 {
		h, err := f.MemCreateShareable(0, gran, cuda.ShareablePOSIXFD)
		if err != nil {
			t.Fatal(err)
		}
		sh, err := f.MemExportShareable(0, h, cuda.ShareablePOSIXFD)
		if err != nil {
			t.Fatal(err)
		}
		defer f.CloseFD(sh.FD)
		hs = append(hs, h)
		s.FDs = append(s.FDs, int32(sh.FD))
	}
	b, err := vmem.EncodeSegment(s)
	if err != nil {
		t.Fatal(err)
	}
	sent, err := vmem.ParseStorageHandle(b)
	if err != nil {
		t.Fatal(err)
	}
	c := vmem.NewImportCache(f.Driver)
	base, err := c.Open(1, sent.Segment)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	if f.liveHandles()-handles != 4 || f.mappedBytes()-mapped != 2*gran || f.liveReserves()-reserves != 1 {
		t.Errorf("after the import: %d handles, %d bytes mapped, %d reservations", f.liveHandles()-handles, f.mappedBytes()-mapped, f.liveReserves()-reserves)
	}
	if again, err := c.Open(1, sent.Segment); err != nil || again != base {
		t.Fatalf("second Open = %#x, %v", again, err)
	}
	for range 2 {
		if err := c.Release(base); err != nil {
			t.Fatal(err)
		}
	}
	for _, h := range hs {
		if err := f.MemRelease(0, h); err != nil {
			t.Fatal(err)
		}
	}
	if f.liveHandles() != handles || f.mappedBytes() != mapped || f.liveReserves() != reserves {
		t.Errorf("left behind: %d handles, %d bytes mapped, %d reservations", f.liveHandles()-handles, f.mappedBytes()-mapped, f.liveReserves()-reserves)
	}
	if got := f.depth(); got != 0 {
		t.Errorf("context stack depth %d", got)
	}
}

// The allocator shares expandable memory through the real driver's code
// and the real system calls, with stitching (the default, named: 2 MiB
// pages) and without (20 MiB chunks): the handle lists the block's
// physical allocations as descriptors of this process (or their fabric
// handles where fabric handles work), the import takes the descriptors
// with pidfd_getfd (on oneself) and maps them, and each descriptor closes
// when its allocation is released.
func TestFakeAllocatorShareExpandable(t *testing.T) {
	for _, c := range []struct {
		name string
		env  string
		kind cuda.ShareableKind
	}{
		{"fd", "FAKECUDA_NO_FABRIC", cuda.ShareablePOSIXFD},
		{"fabric export fails", "FAKECUDA_FABRIC_EXPORT_FAILS", cuda.ShareablePOSIXFD},
		{"fabric", "", cuda.ShareableFabric},
	} {
		for _, conf := range []struct {
			name       string
			conf       string
			pages, seg uint64 // under the 5 MiB block
		}{
			{"stitching", "expandable_segments:True", 3, 2 << 20},                  // 2 MiB pages
			{"no stitching", "expandable_segments:True,stitch:False", 1, 20 << 20}, // one 20 MiB chunk
		} {
			t.Run(c.name+"/"+conf.name, func(t *testing.T) {
				shareExpandable(t, c.env, c.kind, conf.conf, conf.pages, conf.seg)
			})
		}
	}
}

// shareExpandable exports a 5 MiB block of expandable memory under conf,
// with the fake's environment variable env set, and checks that its handle
// is of kind, lists pages allocations of seg bytes, imports once and keeps
// its descriptors until their allocations' release.
func shareExpandable(t *testing.T, env string, kind cuda.ShareableKind, conf string, pages, seg uint64) {
	if env != "" {
		t.Setenv(env, "1")
	}
	f := openFake(t)
	if kind == cuda.ShareablePOSIXFD {
		skipWithoutPidfd(t, f)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cfg, _, err := allocator.ParseConfig(conf)
	if err != nil {
		t.Fatal(err)
	}
	a, err := allocator.New(f.Driver, cfg)
	if err != nil {
		t.Fatal(err)
	}
	a.ExpectAnnouncements()
	p, err := a.Malloc(&allocator.MallocRequest{Dev: 0, Size: 5 << 20})
	if err != nil {
		t.Fatal(err)
	}
	raw, off, dev, err := a.ShareIpcHandle(p)
	if err != nil {
		t.Fatal(err)
	}
	h, err := vmem.ParseStorageHandle(raw)
	if err != nil {
		t.Fatal(err)
	}
	s := h.Segment
	if dev != 0 || h.Type != vmem.TypeExpandable || s.Kind != kind || s.PID != int32(os.Getpid()) || uint64(s.Len()) != pages || s.SegmentSize != seg {
		t.Fatalf("handle %+v (type %q), offset %d, device %d", s, h.Type, off, dev)
	}
	imports := f.imports()
	base, err := a.OpenIpcHandle(1, raw)
	if err != nil {
		t.Fatalf("OpenIpcHandle: %v", err)
	}
	if got := uint64(f.imports() - imports); got != pages {
		t.Errorf("%d imports, want %d", got, pages)
	}
	if again, err := a.OpenIpcHandle(1, raw); err != nil || again != base {
		t.Fatalf("second open = %#x, %v", again, err)
	}
	for range 2 {
		if err := a.IpcClose(base); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Free(allocator.FreeRequest{Ptr: p}); err != nil {
		t.Fatal(err)
	}
	if kind == cuda.ShareablePOSIXFD {
		for _, fd := range s.FDs {
			if !fdOpen(int(fd)) {
				t.Fatalf("the exported descriptor %d closed before its allocation's release", fd)
			}
		}
		if err := a.EmptyCache(0); err != nil {
			t.Fatal(err)
		}
		for _, fd := range s.FDs {
			if fdOpen(int(fd)) {
				t.Errorf("descriptor %d still open after its allocation's release", fd)
			}
		}
	} else if err := a.EmptyCache(0); err != nil {
		t.Fatal(err)
	}
	if n, fds, err := a.ExportStats(0); err != nil || n+fds != 0 {
		t.Errorf("exports left: %d (%d descriptors), %v", n, fds, err)
	}
}

// fdOpen reports whether fd is an open descriptor of this process.
func fdOpen(fd int) bool {
	_, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), syscall.F_GETFD, 0)
	return errno == 0
}
