// SPDX-License-Identifier: Apache-2.0

package vmem

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

var _ ImportDriver = (*sim.Driver)(nil)

const shareGran = sim.Granularity

// shareExporter plays a process with an expandable segment: n physical
// allocations of seg bytes mapped back to back, each filled with its own
// byte, exported through kind.
type shareExporter struct {
	d       *sim.Driver
	base    cuda.Ptr
	handles []cuda.MemHandle
	share   SegmentShare
}

func newShareExporter(t testing.TB, d *sim.Driver, n int, seg uint64, kind cuda.ShareableKind) *shareExporter {
	t.Helper()
	x := &shareExporter{d: d}
	base, err := d.MemAddressReserve(0, uint64(n)*seg)
	if err != nil {
		t.Fatal(err)
	}
	x.base = base
	x.share = SegmentShare{PID: int32(d.PID()), SegmentSize: seg, Kind: kind}
	for i := range n {
		h, err := d.MemCreateShareable(0, seg, kind)
		if err != nil {
			t.Fatal(err)
		}
		p := base + cuda.Ptr(uint64(i)*seg)
		if err := d.MemMap(0, p, seg, h); err != nil {
			t.Fatal(err)
		}
		if err := d.MemSetAccess(0, p, seg); err != nil {
			t.Fatal(err)
		}
		if err := d.WriteDevice(0, p, bytes.Repeat([]byte{byte('A' + i)}, 16)); err != nil {
			t.Fatal(err)
		}
		sh, err := d.MemExportShareable(0, h, kind)
		if err != nil {
			t.Fatal(err)
		}
		if kind == cuda.ShareablePOSIXFD {
			x.share.FDs = append(x.share.FDs, int32(sh.FD))
		} else {
			x.share.Fabric = append(x.share.Fabric, sh.Fabric)
		}
		x.handles = append(x.handles, h)
	}
	return x
}

// shareWire sends s through PyTorch's bytes, as torch.multiprocessing would.
func shareWire(t testing.TB, s SegmentShare) SegmentShare {
	t.Helper()
	b, err := EncodeSegment(s)
	if err != nil {
		t.Fatal(err)
	}
	h, err := ParseStorageHandle(b)
	if err != nil {
		t.Fatal(err)
	}
	return h.Segment
}

// assertImportsGone checks that the importer holds no mapping, reservation,
// handle or descriptor.
func assertImportsGone(t *testing.T, c *ImportCache, imp *sim.Driver) {
	t.Helper()
	if n, refs, res := c.Stats(); n != 0 || refs != 0 || res != 0 {
		t.Errorf("cache holds %d entries, %d references, %d bytes", n, refs, res)
	}
	if n, _ := imp.Reservations(0); n != 0 || imp.Handles(0) != 0 || imp.Mapped(0) != 0 {
		t.Errorf("importer keeps %d reservations, %d handles, %d bytes mapped", n, imp.Handles(0), imp.Mapped(0))
	}
	if fds := imp.OpenFDs(); len(fds) != 0 {
		t.Errorf("importer keeps descriptors %v", fds)
	}
}

// A segment shared by another process maps once, at a reservation of
// exactly its size, shows the shareExporter's bytes in order, serves a second
// open of a handle with other padding bytes, and goes with the last
// release, leaving the shareExporter's memory to the shareExporter.
func TestImportCacheOpenRelease(t *testing.T) {
	for _, kind := range []cuda.ShareableKind{cuda.ShareablePOSIXFD, cuda.ShareableFabric} {
		t.Run(kind.String(), func(t *testing.T) {
			exp := sim.New(sim.Options{})
			imp := sim.New(sim.Options{})
			x := newShareExporter(t, exp, 3, 2*shareGran, kind)
			c := NewImportCache(imp)

			base, err := c.Open(0, shareWire(t, x.share))
			if err != nil {
				t.Fatal(err)
			}
			for i := range 3 {
				got, err := imp.ReadDevice(0, base+cuda.Ptr(uint64(i)*2*shareGran), 16)
				if err != nil || !bytes.Equal(got, bytes.Repeat([]byte{byte('A' + i)}, 16)) {
					t.Fatalf("allocation %d reads %q, %v", i, got, err)
				}
			}
			if !imp.Accessible(0, base, 6*shareGran) {
				t.Error("the import is not accessible")
			}
			if n, res := imp.Reservations(0); n != 1 || res != 6*shareGran {
				t.Errorf("%d reservations of %d bytes, want one of exactly the %d shared", n, res, 6*shareGran)
			}

			b, _ := EncodeSegment(x.share)
			copy(b[6:10], []byte{1, 2, 3, 4}) // padding PyTorch left dirty
			h, err := ParseStorageHandle(b)
			if err != nil {
				t.Fatal(err)
			}
			again, err := c.Open(0, h.Segment)
			if err != nil || again != base {
				t.Fatalf("second open = %#x, %v; want %#x", again, err, base)
			}
			if n, refs, res := c.Stats(); n != 1 || refs != 2 || res != 6*shareGran {
				t.Errorf("stats %d entries, %d refs, %d bytes", n, refs, res)
			}
			if err := imp.WriteDevice(0, base+cuda.Ptr(4*shareGran)+5, []byte("hi")); err != nil {
				t.Fatal(err)
			}
			if got, _ := exp.ReadDevice(0, x.base+cuda.Ptr(4*shareGran)+5, 2); string(got) != "hi" {
				t.Errorf("the shareExporter reads %q", got)
			}

			if err := c.Release(base); err != nil {
				t.Fatal(err)
			}
			if imp.Mapped(0) != 6*shareGran {
				t.Error("the first release unmapped")
			}
			if err := c.Release(base); err != nil {
				t.Fatal(err)
			}
			assertImportsGone(t, c, imp)
			if err := c.Release(base); !errors.Is(err, ErrUnknownImport) {
				t.Errorf("third release: %v", err)
			}
			if exp.Used(0) != 6*shareGran || imp.Violations()+exp.Violations() != 0 {
				t.Errorf("shareExporter uses %d, violations %d", exp.Used(0), imp.Violations()+exp.Violations())
			}
		})
	}
}

// The shareExporter may let go of its memory while an import maps it: the
// importer still reads it, and the shareExporter's device is charged until the
// importer's release.
func TestImportCacheOutlivesExporter(t *testing.T) {
	exp := sim.New(sim.Options{})
	imp := sim.New(sim.Options{})
	x := newShareExporter(t, exp, 2, shareGran, cuda.ShareablePOSIXFD)
	c := NewImportCache(imp)
	base, err := c.Open(0, x.share)
	if err != nil {
		t.Fatal(err)
	}
	if err := exp.MemUnmap(0, x.base, 2*shareGran); err != nil {
		t.Fatal(err)
	}
	for i, h := range x.handles {
		if err := exp.MemRelease(0, h); err != nil {
			t.Fatal(err)
		}
		if err := exp.CloseFD(int(x.share.FDs[i])); err != nil {
			t.Fatal(err)
		}
	}
	if got, _ := imp.ReadDevice(0, base+cuda.Ptr(shareGran), 1); string(got) != "B" {
		t.Errorf("after the shareExporter let go the import reads %q", got)
	}
	if exp.Used(0) != 2*shareGran {
		t.Errorf("shareExporter charged %d, want %d while imported", exp.Used(0), 2*shareGran)
	}
	if err := c.Release(base); err != nil {
		t.Fatal(err)
	}
	if exp.Used(0) != 0 {
		t.Errorf("shareExporter charged %d after the importer's release", exp.Used(0))
	}
	assertImportsGone(t, c, imp)
}

// Every failure of the pidfd calls says what is missing and leaves nothing
// behind, including handles imported before the failure.
func TestImportCacheFailures(t *testing.T) {
	exp := sim.New(sim.Options{})
	x := newShareExporter(t, exp, 2, shareGran, cuda.ShareablePOSIXFD)
	for name, c := range map[string]struct {
		setup func(imp *sim.Driver, s *SegmentShare)
		is    error
		want  string
	}{
		"old kernel": {func(imp *sim.Driver, _ *SegmentShare) { imp.SetPidfdErrors(0, syscall.ENOSYS) }, syscall.ENOSYS, "the kernel lacks pidfd_getfd (Linux 5.6+)"},
		"ptrace":     {func(imp *sim.Driver, _ *SegmentShare) { imp.SetPidfdErrors(0, syscall.EPERM) }, syscall.EPERM, "ptrace permission to process"},
		"no pidfd":   {func(imp *sim.Driver, _ *SegmentShare) { imp.SetPidfdErrors(syscall.ENOSYS, 0) }, syscall.ENOSYS, "the kernel lacks pidfd_open"},
		"second descriptor closed": {func(_ *sim.Driver, s *SegmentShare) {
			s.FDs = []int32{s.FDs[0], 999}
		}, syscall.EBADF, "file descriptor 999 is not open in process"},
		"misaligned":   {func(_ *sim.Driver, s *SegmentShare) { s.SegmentSize = shareGran / 2 }, ErrBadHandle, "not a multiple of device 0's granularity"},
		"not a handle": {func(_ *sim.Driver, s *SegmentShare) { s.FDs = nil }, ErrBadHandle, "lists 0 physical allocations"},
	} {
		t.Run(name, func(t *testing.T) {
			imp := sim.New(sim.Options{})
			s := x.share
			s.FDs = append([]int32(nil), s.FDs...)
			c.setup(imp, &s)
			cache := NewImportCache(imp)
			_, err := cache.Open(0, s)
			if !errors.Is(err, c.is) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Open: %v; want %v mentioning %q", err, c.is, c.want)
			}
			assertImportsGone(t, cache, imp)
		})
	}
	// The shareExporter has exited.
	imp := sim.New(sim.Options{})
	cache := NewImportCache(imp)
	exp.Exit()
	_, err := cache.Open(0, x.share)
	if !errors.Is(err, syscall.ESRCH) || !strings.Contains(err.Error(), fmt.Sprintf("process %d has exited", exp.PID())) {
		t.Fatalf("Open from an exited process: %v", err)
	}
	assertImportsGone(t, cache, imp)
}

// Close unmaps everything and refuses later opens.
func TestImportCacheClose(t *testing.T) {
	exp := sim.New(sim.Options{})
	imp := sim.New(sim.Options{})
	x1 := newShareExporter(t, exp, 1, shareGran, cuda.ShareableFabric)
	x2 := newShareExporter(t, exp, 2, shareGran, cuda.ShareableFabric)
	c := NewImportCache(imp)
	for _, s := range []SegmentShare{x1.share, x2.share, x2.share} {
		if _, err := c.Open(0, s); err != nil {
			t.Fatal(err)
		}
	}
	if n, refs, res := c.Stats(); n != 2 || refs != 3 || res != 3*shareGran {
		t.Fatalf("stats %d, %d, %d", n, refs, res)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	assertImportsGone(t, c, imp)
	if _, err := c.Open(0, x1.share); !errors.Is(err, ErrImportCacheClosed) {
		t.Errorf("Open after Close: %v", err)
	}
}

// Ten thousand imports of distinct segments, all open at once, reserve ten
// thousand times the shared bytes: within the simulated device's 16 TiB of
// address space, where PyTorch's policy (9/8 of the 80 GiB device per
// import) would need about 880 TiB.
func TestImportCacheTenThousandImports(t *testing.T) {
	n := 10000
	if testing.Short() {
		n = 1000
	}
	exp := sim.New(sim.Options{Memory: uint64(n+1) * shareGran})
	imp := sim.New(sim.Options{})
	// One physical allocation each, like a small tensor's page.
	shares := make([]SegmentShare, n)
	for i := range shares {
		h, err := exp.MemCreateShareable(0, shareGran, cuda.ShareableFabric)
		if err != nil {
			t.Fatal(err)
		}
		sh, err := exp.MemExportShareable(0, h, cuda.ShareableFabric)
		if err != nil {
			t.Fatal(err)
		}
		shares[i] = SegmentShare{PID: int32(exp.PID()), SegmentSize: shareGran, Kind: cuda.ShareableFabric, Fabric: []cuda.FabricHandle{sh.Fabric}}
	}
	c := NewImportCache(imp)
	bases := make([]cuda.Ptr, n)
	for i, s := range shares {
		p, err := c.Open(0, s)
		if err != nil {
			t.Fatalf("import %d: %v", i, err)
		}
		bases[i] = p
	}
	if entries, _, res := c.Stats(); entries != n || res != uint64(n)*shareGran {
		t.Fatalf("%d entries reserving %d bytes, want %d reserving %d", entries, res, n, uint64(n)*shareGran)
	}
	for _, p := range bases {
		if err := c.Release(p); err != nil {
			t.Fatal(err)
		}
	}
	assertImportsGone(t, c, imp)
}

// Opens and releases from many goroutines, of shared and distinct
// segments, agree (run with -race).
func TestImportCacheConcurrent(t *testing.T) {
	exp := sim.New(sim.Options{})
	imp := sim.New(sim.Options{})
	xs := []*shareExporter{
		newShareExporter(t, exp, 1, shareGran, cuda.ShareablePOSIXFD),
		newShareExporter(t, exp, 2, shareGran, cuda.ShareablePOSIXFD),
		newShareExporter(t, exp, 1, shareGran, cuda.ShareableFabric),
	}
	c := NewImportCache(imp)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				x := xs[(g+i)%len(xs)]
				p, err := c.Open(0, x.share)
				if err != nil {
					errs <- err
					return
				}
				if got, err := imp.ReadDevice(0, p, 1); err != nil || got[0] != 'A' {
					errs <- fmt.Errorf("read %q, %v", got, err)
					return
				}
				if err := c.Release(p); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	assertImportsGone(t, c, imp)
}
