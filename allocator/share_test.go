// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/vmem"
)

// Sharing memory with other processes in PyTorch's handle format
// (share.go; vmem/export.go): two simulated drivers are two processes, each
// with its allocator, exporting and importing expandable and stitched
// memory.

// proc is one simulated process with its allocator.
type proc struct {
	a *allocator.Allocator
	d *sim.Driver
}

// chunked is expandable segments without stitching: the default large
// pool's 20 MiB chunks, grown whole (vmem/export.go, "One size").
// stitching (expandable_segments:True, the default) is expandable segments
// with stitching, whose default pools map 2 MiB pages. Importers run the
// default configuration: an import maps the exporter's memory whatever the
// importer's own segments are.
const chunked = "expandable_segments:True,stitch:False"

// newProc makes a process with one device of mem bytes whose memory can be
// exported through kinds (a device without an IMEX channel: file
// descriptors only).
func newProc(t testing.TB, conf string, kinds cuda.ShareableKind, mem uint64) proc {
	t.Helper()
	cfg, _, err := allocator.ParseConfig(conf)
	require.NoError(t, err)
	d := sim.New(sim.Options{Devices: 1, Memory: mem})
	d.SetShareableKinds(kinds)
	a, err := allocator.New(d, cfg)
	require.NoError(t, err)
	return proc{a, d}
}

// fill writes n bytes of a pattern seeded by seed at p.
func fill(t testing.TB, d *sim.Driver, p cuda.Ptr, n int, seed byte) []byte {
	t.Helper()
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	require.NoError(t, d.WriteDevice(0, p, b))
	return b
}

func read(t testing.TB, d *sim.Driver, p cuda.Ptr, n int) []byte {
	t.Helper()
	b, err := d.ReadDevice(0, p, uint64(n))
	require.NoError(t, err)
	return b
}

// share returns p's handle, decoded, and its offset.
func share(t testing.TB, a *allocator.Allocator, p cuda.Ptr) ([]byte, vmem.StorageHandle, uint64) {
	t.Helper()
	h, off, dev, err := a.ShareIpcHandle(p)
	require.NoError(t, err)
	require.Zero(t, dev)
	sh, err := vmem.ParseStorageHandle(h)
	require.NoError(t, err)
	return h, sh, off
}

// importsGone requires that p's process holds no import: no mapping,
// reservation, physical handle or descriptor.
func importsGone(t testing.TB, p proc) {
	t.Helper()
	n, refs, reserved := p.a.ImportStats()
	require.Zero(t, n+refs)
	require.Zero(t, reserved)
	require.Zero(t, p.d.Mapped(0))
	rn, _ := p.d.Reservations(0)
	require.Zero(t, rn)
	require.Zero(t, p.d.Handles(0))
	require.Empty(t, p.d.OpenFDs())
}

// A block of an expandable segment goes to another process and back: the
// importer reads what the exporter wrote and the exporter reads what the
// importer wrote; the handle lists the physical allocation under the block
// as a descriptor of the exporter, the same bytes for every block of the
// range (with its own offset), and two opens map once. The descriptor is
// closed when its allocation is released, not before.
func TestShareExpandableBothWays(t *testing.T) {
	exp := newProc(t, chunked, cuda.ShareablePOSIXFD, 4*GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD, 4*GiB)
	p := mustMalloc(t, exp.a, 0, 5*MiB, 0)
	q := mustMalloc(t, exp.a, 0, 3*MiB, 0) // the same 20 MiB chunk
	want := fill(t, exp.d, p, 5*MiB, 1)

	raw, h, off := share(t, exp.a, p)
	require.Equal(t, byte(vmem.HandleVersion), raw[0])
	require.Equal(t, byte(vmem.TypeExpandable), h.Type)
	require.Equal(t, int32(exp.d.PID()), h.Segment.PID)
	require.Equal(t, cuda.ShareablePOSIXFD, h.Segment.Kind)
	require.Equal(t, uint64(20*MiB), h.Segment.SegmentSize, "one 20 MiB chunk under the block")
	require.Len(t, h.Segment.FDs, 1)
	require.Equal(t, []int{int(h.Segment.FDs[0])}, exp.d.OpenFDs(), "exported once, lazily")
	rawQ, _, offQ := share(t, exp.a, q)
	require.Equal(t, raw, rawQ, "every handle of one range is the same bytes")
	require.Equal(t, off+5*MiB, offQ)
	again, _, _ := share(t, exp.a, p)
	require.Equal(t, raw, again)
	n, fds, err := exp.a.ExportStats(0)
	require.NoError(t, err)
	require.Equal(t, [2]int{1, 1}, [2]int{n, fds})

	base, err := imp.a.OpenIpcHandle(0, raw)
	require.NoError(t, err)
	require.Equal(t, want, read(t, imp.d, base+cuda.Ptr(off), 5*MiB), "the importer reads the exporter's bytes")
	reply := fill(t, imp.d, base+cuda.Ptr(offQ), 4096, 9)
	require.Equal(t, reply, read(t, exp.d, q, 4096), "and the exporter the importer's")
	base2, err := imp.a.OpenIpcHandle(0, rawQ)
	require.NoError(t, err)
	require.Equal(t, base, base2, "one mapping for both blocks")
	entries, refs, reserved := imp.a.ImportStats()
	require.Equal(t, [3]uint64{1, 2, 20 * MiB}, [3]uint64{uint64(entries), uint64(refs), reserved}, "the import reserves what the handle covers")
	require.Empty(t, imp.d.OpenFDs(), "the importer closed the descriptors it took")
	require.NoError(t, imp.a.IpcClose(base))
	require.NoError(t, imp.a.IpcClose(base2))
	require.ErrorIs(t, imp.a.IpcClose(base), allocator.ErrUnknownPointer, "closed as often as opened")
	importsGone(t, imp)

	// empty_cache keeps what allocated blocks lie on, descriptor included.
	require.NoError(t, exp.a.EmptyCache(0))
	require.Len(t, exp.d.OpenFDs(), 1)
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: p}))
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: q}))
	require.Len(t, exp.d.OpenFDs(), 1, "a free chunk keeps its descriptor until it is released")
	require.NoError(t, exp.a.EmptyCache(0))
	require.Empty(t, exp.d.OpenFDs(), "released with its allocation")
	n, fds, err = exp.a.ExportStats(0)
	require.NoError(t, err)
	require.Zero(t, n+fds)
	require.Zero(t, exp.d.Used(0))
	for _, x := range []proc{exp, imp} {
		require.NoError(t, x.a.CheckInvariants())
		require.Zero(t, x.d.Violations(), "%v", x.d.ViolationLog())
	}
}

// Without stitching, a block larger than the mapping unit lies on whole 20
// MiB chunks (growth maps whole chunks in the default pools, as PyTorch's
// pages), listed in order; a block of the small pool lies on one 2 MiB
// page.
func TestShareLargeAndSmallBlocks(t *testing.T) {
	exp := newProc(t, chunked, cuda.ShareablePOSIXFD, 4*GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD, 4*GiB)
	big := mustMalloc(t, exp.a, 0, 50*MiB, 0)
	require.Equal(t, uint64(60*MiB), exp.d.Mapped(0), "three whole chunks")
	small := mustMalloc(t, exp.a, 0, 1000, 0)
	want := fill(t, exp.d, big, 50*MiB, 3)
	wantSmall := fill(t, exp.d, small, 1000, 4)

	raw, h, off := share(t, exp.a, big)
	require.Zero(t, off)
	require.Equal(t, uint64(20*MiB), h.Segment.SegmentSize)
	require.Len(t, h.Segment.FDs, 3)
	rawS, hs, offS := share(t, exp.a, small)
	require.Equal(t, uint64(2*MiB), hs.Segment.SegmentSize)
	require.Len(t, hs.Segment.FDs, 1)

	base, err := imp.a.OpenIpcHandle(0, raw)
	require.NoError(t, err)
	require.Equal(t, want, read(t, imp.d, base, 50*MiB))
	bs, err := imp.a.OpenIpcHandle(0, rawS)
	require.NoError(t, err)
	require.Equal(t, wantSmall, read(t, imp.d, bs+cuda.Ptr(offS), 1000))
	_, _, reserved := imp.a.ImportStats()
	require.Equal(t, uint64(62*MiB), reserved)
	require.NoError(t, imp.a.IpcClose(base))
	require.NoError(t, imp.a.IpcClose(bs))
	importsGone(t, imp)
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: big}))
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: small}))
	require.NoError(t, exp.a.EmptyCache(0))
	require.Empty(t, exp.d.OpenFDs())
}

// Where fabric handles work (ProbeFabric), physical memory is created and
// exported with them, as PyTorch 2.11 chooses: no descriptor is held, the
// handle's entries are 64 bytes (one per 2 MiB page under the block, with
// stitching), and the import needs no pidfd.
func TestShareFabric(t *testing.T) {
	exp := newProc(t, stitching, cuda.ShareablePOSIXFD|cuda.ShareableFabric, 4*GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD|cuda.ShareableFabric, 4*GiB)
	imp.d.SetPidfdErrors(syscall.ENOSYS, syscall.ENOSYS) // not needed
	p := mustMalloc(t, exp.a, 0, 3*MiB, 0)
	want := fill(t, exp.d, p, 3*MiB, 5)
	raw, h, off := share(t, exp.a, p)
	require.Equal(t, cuda.ShareableFabric, h.Segment.Kind)
	require.Len(t, h.Segment.Fabric, 2, "3 MiB on two pages")
	require.Len(t, raw, 2+24+2*64)
	require.Empty(t, exp.d.OpenFDs())
	base, err := imp.a.OpenIpcHandle(0, raw)
	require.NoError(t, err)
	require.Equal(t, want, read(t, imp.d, base+cuda.Ptr(off), 3*MiB))
	require.NoError(t, imp.a.IpcClose(base))
	importsGone(t, imp)
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: p}))
}

// The kind is chosen once per device at its first growth: descriptors
// where fabric handles do not work, and where the first growth happens
// during a capture (the probe would release memory); with neither, memory
// is not shareable and the export says why.
func TestShareKindChoice(t *testing.T) {
	lockThread(t)
	x := newProc(t, stitching, cuda.ShareablePOSIXFD|cuda.ShareableFabric, GiB)
	x.a.ExpectAnnouncements()
	const cs = cuda.Stream(7)
	require.NoError(t, x.a.BeginAllocateToPool(0, allocator.PoolID{A: 1}, func(cuda.Stream) bool { return true }))
	require.NoError(t, x.d.BeginCapture(cs, cuda.CaptureModeGlobal))
	p := mustMalloc(t, x.a, 0, 3*MiB, cs)
	_, h, _ := share(t, x.a, p) // legal during the capture
	require.NoError(t, x.d.EndCapture(cs))
	require.NoError(t, x.a.EndAllocateToPool(0, allocator.PoolID{A: 1}))
	require.Equal(t, cuda.ShareablePOSIXFD, h.Segment.Kind, "chosen during a capture: no probe")
	require.Zero(t, x.d.Violations(), "%v", x.d.ViolationLog())

	none := newProc(t, stitching, 0, GiB)
	q := mustMalloc(t, none.a, 0, 3*MiB, 0)
	_, _, _, err := none.a.ShareIpcHandle(q)
	require.ErrorIs(t, err, allocator.ErrNotSupported)
	require.Contains(t, err.Error(), "was not created shareable: device 0 exports physical memory neither as file descriptors nor as fabric handles")
}

// A block of an ordinary segment is shared as its segment's CUDA IPC
// handle, type 'c', which OpenIpcHandle opens with the driver's IPC.
func TestShareCudaMalloc(t *testing.T) {
	a, drv := newAlloc(t, 1, GiB, ordinary)
	p := mustMalloc(t, a, 0, 4096, 0)
	q := mustMalloc(t, a, 0, 4096, 0)
	raw, h, off := share(t, a, q)
	require.Equal(t, byte(vmem.TypeCudaMalloc), h.Type)
	ipc, ipcOff, _, err := a.IpcHandle(q)
	require.NoError(t, err)
	require.Equal(t, vmem.EncodeCudaMalloc(ipc), raw)
	require.Equal(t, ipcOff, off)
	m, err := a.OpenIpcHandle(0, raw)
	require.NoError(t, err)
	m2, err := a.OpenIpcHandle(0, raw[2:]) // a bare cudaIpcMemHandle_t, from an older PyTorch
	require.NoError(t, err)
	require.Equal(t, m, m2)
	_, src, ok := drv.IpcSource(0, m+cuda.Ptr(off))
	require.True(t, ok)
	require.Equal(t, q, src)
	require.NoError(t, a.IpcClose(m))
	require.NoError(t, a.IpcClose(m2))
	for _, x := range []cuda.Ptr{p, q} {
		require.NoError(t, a.Free(allocator.FreeRequest{Ptr: x}))
	}
}

// Bytes that are no handle, a newer PyTorch's handle, a pointer that is
// not an allocation's start, and an unknown device are refused with errors
// that say which.
func TestShareRefusals(t *testing.T) {
	x := newProc(t, stitching, cuda.ShareablePOSIXFD, GiB)
	p := mustMalloc(t, x.a, 0, 3*MiB, 0)
	raw, _, _ := share(t, x.a, p)
	for _, c := range []struct {
		h    []byte
		want string
	}{
		{[]byte{2}, "a handle of 1 bytes"},
		{append([]byte{3}, raw[1:]...), "version 3"},
		{append([]byte{2, 'x'}, raw[2:]...), `type 'x'`},
		{raw[:len(raw)-1], "physical allocations in"},
	} {
		_, err := x.a.OpenIpcHandle(0, c.h)
		require.ErrorIs(t, err, allocator.ErrInvalidArgument)
		require.ErrorIs(t, err, vmem.ErrBadHandle)
		require.Contains(t, err.Error(), c.want)
	}
	_, err := x.a.OpenIpcHandle(3, raw)
	require.ErrorIs(t, err, allocator.ErrInvalidDevice)
	_, _, _, err = x.a.ShareIpcHandle(p + 8)
	require.ErrorIs(t, err, allocator.ErrUnknownPointer)
	require.Contains(t, err.Error(), "not at its start")
	require.NoError(t, x.a.Free(allocator.FreeRequest{Ptr: p}))
	_, _, _, err = x.a.ShareIpcHandle(p)
	require.ErrorIs(t, err, allocator.ErrAlreadyFreed)
	require.ErrorIs(t, x.a.IpcClose(0x1234), allocator.ErrUnknownPointer)
}

// A kernel or a permission that does not let the importer take the
// exporter's descriptors is a clear error that says what is missing,
// returned at once, and the failed import leaves nothing behind; so is an
// exporter that has exited.
func TestSharePidfdErrors(t *testing.T) {
	exp := newProc(t, stitching, cuda.ShareablePOSIXFD, GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD, GiB)
	p := mustMalloc(t, exp.a, 0, 3*MiB, 0)
	raw, _, _ := share(t, exp.a, p)
	pid := exp.d.PID()
	for _, c := range []struct {
		open, getfd syscall.Errno
		kind        error
		want        string
	}{
		{syscall.ENOSYS, 0, allocator.ErrNotSupported, "the kernel lacks pidfd_open (Linux 5.3+)"},
		{0, syscall.ENOSYS, allocator.ErrNotSupported, "the kernel lacks pidfd_getfd (Linux 5.6+)"},
		{0, syscall.EPERM, allocator.ErrNotSupported, fmt.Sprintf("ptrace permission to process %d is needed", pid)},
		{0, syscall.EMFILE, allocator.ErrNotSupported, "RLIMIT_NOFILE"},
	} {
		imp.d.SetPidfdErrors(c.open, c.getfd)
		_, err := imp.a.OpenIpcHandle(0, raw)
		require.ErrorIs(t, err, c.kind)
		var pe *cuda.PidfdError
		require.ErrorAs(t, err, &pe)
		require.ErrorIs(t, err, c.open|c.getfd)
		require.Contains(t, err.Error(), c.want)
		require.Contains(t, err.Error(), fmt.Sprintf("importing memory shared by process %d", pid))
		importsGone(t, imp)
	}
	imp.d.SetPidfdErrors(0, 0)
	exp.d.Exit()
	_, err := imp.a.OpenIpcHandle(0, raw)
	require.ErrorIs(t, err, allocator.ErrInvalidArgument)
	require.Contains(t, err.Error(), fmt.Sprintf("process %d has exited", pid))
	importsGone(t, imp)
}

// The allocations under a block must be of one size: without stitching, a
// block over a whole chunk and a tail mapped short (the memory fraction had
// no room for a whole chunk) cannot be shared, and the error says why.
func TestShareRefusesMixedAllocations(t *testing.T) {
	x := newProc(t, chunked, cuda.ShareablePOSIXFD, GiB)
	require.NoError(t, x.a.SetMemoryFraction(0, 30.0/1024))
	a := mustMalloc(t, x.a, 0, 19*MiB, 0) // one 20 MiB chunk
	b := mustMalloc(t, x.a, 0, 4*MiB, 0)  // 1 MiB of it and a 4 MiB tail
	require.Equal(t, uint64(24*MiB), x.d.Mapped(0))
	_, _, _, err := x.a.ShareIpcHandle(b)
	require.ErrorIs(t, err, allocator.ErrNotSupported)
	require.Contains(t, err.Error(), "lies on physical allocations of 20971520 and 4194304 bytes")
	_, h, _ := share(t, x.a, a)
	require.Len(t, h.Segment.FDs, 1, "a block on one chunk is shared")
	for _, p := range []cuda.Ptr{a, b} {
		require.NoError(t, x.a.Free(allocator.FreeRequest{Ptr: p}))
	}
}

// Each exported allocation holds a descriptor until its release: an export
// beyond the process's limit of open files fails, saying how many
// descriptors exports hold and what the limit is, and works again once
// memory was released.
func TestShareDescriptorLimit(t *testing.T) {
	x := newProc(t, "stitch:True,expandable_map_unit_mb:2", cuda.ShareablePOSIXFD, GiB)
	x.d.SetFDLimit(3 + 4) // four descriptors
	var ps []cuda.Ptr
	for range 5 {
		ps = append(ps, mustMalloc(t, x.a, 0, 2*MiB, 0))
	}
	for _, p := range ps[:4] {
		share(t, x.a, p)
	}
	_, _, _, err := x.a.ShareIpcHandle(ps[4])
	require.ErrorIs(t, err, allocator.ErrDriver)
	require.ErrorIs(t, err, syscall.EMFILE)
	require.Contains(t, err.Error(), "exporting physical allocation 1 of 1 on device 0 as a posix-fd handle (exported memory holds 4 file descriptors of this process; its limit of open files, RLIMIT_NOFILE, is 7")
	require.NoError(t, x.a.Free(allocator.FreeRequest{Ptr: ps[0]}))
	require.NoError(t, x.a.EmptyCache(0))
	share(t, x.a, ps[4])
	for _, p := range ps[1:] {
		require.NoError(t, x.a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.NoError(t, x.a.EmptyCache(0))
	require.Empty(t, x.d.OpenFDs())
}

// physIDs returns the simulator's ids of the physical memory under each
// page of [p, p+n).
func physIDs(t testing.TB, d *sim.Driver, p cuda.Ptr, n uint64) []uint64 {
	t.Helper()
	var ids []uint64
	for o := uint64(0); o < n; o += 2 * MiB {
		id, _, ok := d.PhysicalAt(0, p+cuda.Ptr(o))
		require.True(t, ok)
		ids = append(ids, id)
	}
	return ids
}

// Stitching while memory is exported (vmem/export.go, "Exported pages and
// stitching"): the pages under an exported block that is still allocated
// never move, so what the importer maps stays the exporter's block while
// the exporter stitches around it, both ways; once the block is freed its
// pages move like any other, each keeping its handle and descriptor, so
// that the block the moved page then backs is exported through the same
// descriptor; a release closes it.
func TestShareWhileStitching(t *testing.T) {
	lockThread(t)
	exp := newProc(t, stitch, cuda.ShareablePOSIXFD, GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD, GiB)
	e := mustMalloc(t, exp.a, 0, 6*MiB, 0)
	want := fill(t, exp.d, e, 6*MiB, 11)
	ids := physIDs(t, exp.d, e, 6*MiB)
	raw, h, off := share(t, exp.a, e)
	require.Len(t, h.Segment.FDs, 3, "three pages")
	base, err := imp.a.OpenIpcHandle(0, raw)
	require.NoError(t, err)

	// Holes on both sides, then misses that move their pages.
	h1, h2, keep := holes(t, exp.a, 0)
	big := mustMalloc(t, exp.a, 0, 16*MiB, 0)
	require.Positive(t, stitchStats(t, exp.a).Remaps, "pages moved")
	fill(t, exp.d, big, 16*MiB, 77)
	require.Equal(t, ids, physIDs(t, exp.d, e, 6*MiB), "the exported block's pages did not move")
	require.Equal(t, want, read(t, imp.d, base+cuda.Ptr(off), 6*MiB), "the importer still sees the block")
	reply := fill(t, imp.d, base+cuda.Ptr(off), 6*MiB, 99)
	require.Equal(t, reply, read(t, exp.d, e, 6*MiB), "and the exporter sees the importer's writes")
	// empty_cache releases free pages only: the exported ones stay.
	require.NoError(t, exp.a.EmptyCache(0))
	require.Equal(t, ids, physIDs(t, exp.d, e, 6*MiB))
	for _, fd := range h.Segment.FDs {
		require.Contains(t, exp.d.OpenFDs(), int(fd))
	}
	require.Equal(t, reply, read(t, imp.d, base+cuda.Ptr(off), 6*MiB))
	require.NoError(t, imp.a.IpcClose(base))
	importsGone(t, imp)

	// Freed, the block's pages move: each keeps its descriptor.
	fdOf := map[uint64]int32{}
	for i, id := range ids {
		fdOf[id] = h.Segment.FDs[i]
	}
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: e}))
	fdsBefore := exp.d.OpenFDs()
	remaps := stitchStats(t, exp.a).Remaps
	// A 32 MiB request on another stream cannot use the 6 MiB hole and
	// takes its idle pages.
	exp.d.CompleteAll()
	mover := mustMalloc(t, exp.a, 0, 32*MiB, 5)
	require.Greater(t, stitchStats(t, exp.a).Remaps, remaps)
	moved := 0
	mids := physIDs(t, exp.d, mover, 32*MiB)
	_, hm, _ := share(t, exp.a, mover)
	for i, id := range mids {
		if fd, ok := fdOf[id]; ok {
			moved++
			require.Equal(t, fd, hm.Segment.FDs[i], "a moved page keeps its descriptor")
		}
	}
	require.Positive(t, moved, "the freed block's pages moved to the new block")
	require.Len(t, exp.d.OpenFDs(), len(fdsBefore)+len(mids)-moved, "one new descriptor per page exported for the first time")

	for _, p := range append(keep, big, mover) {
		require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: p}))
	}
	_ = h1
	_ = h2
	exp.d.CompleteAll()
	require.NoError(t, exp.a.EmptyCache(0))
	require.Empty(t, exp.d.OpenFDs(), "every descriptor closed with its allocation's release")
	require.Zero(t, exp.d.Used(0))
	require.NoError(t, exp.a.CheckInvariants())
	require.Zero(t, exp.d.Violations(), "%v", exp.d.ViolationLog())
}

// A handle in flight names descriptor numbers: while its block is
// allocated, nothing the exporter does (other exports, releases,
// empty_cache, stitching) closes them, so no other export gets their
// numbers, and the handle imports the block's own memory however late it
// is opened (cuda/sim's TestShareDescriptorNumberReuse shows what happens
// otherwise).
func TestShareDescriptorNumberNotReused(t *testing.T) {
	lockThread(t)
	exp := newProc(t, stitch, cuda.ShareablePOSIXFD, GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD, GiB)
	e := mustMalloc(t, exp.a, 0, 2*MiB, 0)
	want := fill(t, exp.d, e, 2*MiB, 21)
	id := physIDs(t, exp.d, e, 2*MiB)[0]
	raw, h, _ := share(t, exp.a, e) // in flight from here on
	fd := int(h.Segment.FDs[0])

	// Churn: blocks exported and freed, memory released, pages stitched.
	for i := range 20 {
		p := mustMalloc(t, exp.a, 0, uint64(2+i%3)*2*MiB, cuda.Stream(i%2))
		fill(t, exp.d, p, 4096, byte(i))
		_, hp, _ := share(t, exp.a, p)
		for _, f := range hp.Segment.FDs {
			require.NotEqual(t, fd, int(f), "another export got the in-flight descriptor's number")
		}
		require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: p}))
		if i%4 == 3 {
			exp.d.CompleteAll()
			require.NoError(t, exp.a.EmptyCache(0))
		}
	}
	require.Contains(t, exp.d.OpenFDs(), fd)
	base, err := imp.a.OpenIpcHandle(0, raw)
	require.NoError(t, err)
	got, _, ok := imp.d.PhysicalAt(0, base)
	require.True(t, ok)
	require.Equal(t, id, got, "the late import maps the block's own memory")
	require.Equal(t, want, read(t, imp.d, base, 2*MiB))
	require.NoError(t, imp.a.IpcClose(base))
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: e}))
	exp.d.CompleteAll()
	require.NoError(t, exp.a.EmptyCache(0))
	require.NotContains(t, exp.d.OpenFDs(), fd, "closed with its allocation's release")
	importsGone(t, imp)
}

// Ten thousand distinct tensors, each on its own physical allocation, are
// opened at once in one consumer: each import reserves only the bytes its
// handle covers (2 MiB), 20 GB in all, where PyTorch's 9/8 of the device
// per import would need 900 TiB. Each close gives its range back.
func TestShareTenThousandImports(t *testing.T) {
	n := 10000
	if testing.Short() {
		n = 1000
	}
	exp := newProc(t, stitch, cuda.ShareablePOSIXFD, uint64(n)*2*MiB+GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD, 80*GiB)
	ps := make([]cuda.Ptr, n)
	raws := make([][]byte, n)
	for i := range ps {
		ps[i] = mustMalloc(t, exp.a, 0, 2*MiB, 0)
		require.NoError(t, exp.d.WriteDevice(0, ps[i], []byte(fmt.Sprintf("tensor %d", i))))
		raws[i], _, _ = share(t, exp.a, ps[i])
	}
	_, fds, err := exp.a.ExportStats(0)
	require.NoError(t, err)
	require.Equal(t, n, fds)
	bases := make([]cuda.Ptr, n)
	for i, raw := range raws {
		bases[i], err = imp.a.OpenIpcHandle(0, raw)
		require.NoError(t, err)
	}
	entries, refs, reserved := imp.a.ImportStats()
	require.Equal(t, n, entries)
	require.Equal(t, n, refs)
	require.Equal(t, uint64(n)*2*MiB, reserved)
	for _, i := range []int{0, n / 2, n - 1} {
		want := fmt.Sprintf("tensor %d", i)
		require.Equal(t, want, string(read(t, imp.d, bases[i], len(want))))
	}
	for _, b := range bases {
		require.NoError(t, imp.a.IpcClose(b))
	}
	importsGone(t, imp)
	for _, p := range ps {
		require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: p}))
	}
	require.NoError(t, exp.a.EmptyCache(0))
	require.Empty(t, exp.d.OpenFDs())
}

// Exports, imports and closes from many goroutines of both processes, with
// mallocs and frees between them, agree (run with -race).
func TestShareConcurrent(t *testing.T) {
	x := newProc(t, stitch, cuda.ShareablePOSIXFD, 4*GiB)
	y := newProc(t, stitch, cuda.ShareablePOSIXFD, 4*GiB)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			from, to := x, y
			if g%2 == 1 {
				from, to = y, x
			}
			for i := range 30 {
				size := uint64(1+(g+i)%5) * MiB
				p, err := from.a.Malloc(&allocator.MallocRequest{Size: size, Stream: cuda.Stream(g % 3)})
				if err != nil {
					errs <- err
					return
				}
				tag := []byte(fmt.Sprintf("g%d i%d", g, i))
				if err := from.d.WriteDevice(0, p, tag); err != nil {
					errs <- err
					return
				}
				raw, off, _, err := from.a.ShareIpcHandle(p)
				if err != nil {
					errs <- err
					return
				}
				base, err := to.a.OpenIpcHandle(0, raw)
				if err != nil {
					errs <- err
					return
				}
				got, err := to.d.ReadDevice(0, base+cuda.Ptr(off), uint64(len(tag)))
				if err == nil && !bytes.Equal(got, tag) {
					err = fmt.Errorf("read %q, want %q", got, tag)
				}
				if err == nil {
					err = to.a.IpcClose(base)
				}
				if err == nil {
					err = from.a.Free(allocator.FreeRequest{Ptr: p})
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for _, p := range []proc{x, y} {
		n, refs, _ := p.a.ImportStats()
		require.Zero(t, n+refs)
		p.d.CompleteAll()
		require.NoError(t, p.a.EmptyCache(0))
		require.NoError(t, p.a.CheckInvariants())
		require.Empty(t, p.d.OpenFDs())
		require.Zero(t, p.d.Used(0))
	}
}

// Opening an import runs in relaxed capture mode, like every mapping the
// allocator makes: a capture under way (global mode, begun by this very
// thread) stays valid.
func TestShareOpenDuringCapture(t *testing.T) {
	lockThread(t)
	exp := newProc(t, stitching, cuda.ShareablePOSIXFD, GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD, GiB)
	p := mustMalloc(t, exp.a, 0, 3*MiB, 0)
	raw, _, _ := share(t, exp.a, p)
	const cs = cuda.Stream(9)
	require.NoError(t, imp.d.BeginCapture(cs, cuda.CaptureModeGlobal))
	base, err := imp.a.OpenIpcHandle(0, raw)
	require.NoError(t, err)
	require.NoError(t, imp.d.EndCapture(cs), "the capture stayed valid: %v", imp.d.ViolationLog())
	require.Zero(t, imp.d.Violations())
	require.NoError(t, imp.a.IpcClose(base))
	importsGone(t, imp)
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: p}))
}

// With expandable segments and stitching every physical
// allocation of the default pools is one 2 MiB page, whichever size class
// mapped it, so a block is shareable wherever stitching took its pages
// from: a large block's pages move to the small pool and back (vmem/doc.go,
// "One page pool for both size classes"), each keeping its descriptor, and
// every block is shared, imported and written both ways on the way.
func TestShareStitchingAcrossSizeClasses(t *testing.T) {
	lockThread(t)
	exp := newProc(t, stitching, cuda.ShareablePOSIXFD, GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD, GiB)
	roundTrip := func(p cuda.Ptr, n int, seed byte) vmem.StorageHandle {
		t.Helper()
		want := fill(t, exp.d, p, n, seed)
		raw, h, off := share(t, exp.a, p)
		require.Equal(t, byte(vmem.TypeExpandable), h.Type)
		require.Equal(t, uint64(2*MiB), h.Segment.SegmentSize, "pages of one size under every block")
		base, err := imp.a.OpenIpcHandle(0, raw)
		require.NoError(t, err)
		require.Equal(t, want, read(t, imp.d, base+cuda.Ptr(off), n))
		reply := fill(t, imp.d, base+cuda.Ptr(off), n, seed+1)
		require.Equal(t, reply, read(t, exp.d, p, n))
		require.NoError(t, imp.a.IpcClose(base))
		return h
	}
	fdOf := map[uint64]int32{}
	record := func(p cuda.Ptr, n uint64, h vmem.StorageHandle) {
		t.Helper()
		ids := physIDs(t, exp.d, p-cuda.Ptr(uint64(p)%(2*MiB)), n+uint64(p)%(2*MiB))
		require.Len(t, h.Segment.FDs, len(ids))
		for i, id := range ids {
			if fd, ok := fdOf[id]; ok {
				require.Equal(t, fd, h.Segment.FDs[i], "a moved page keeps its descriptor")
			}
			fdOf[id] = h.Segment.FDs[i]
		}
	}

	big := mustMalloc(t, exp.a, 0, 30*MiB, 0)
	record(big, 30*MiB, roundTrip(big, 30*MiB, 1))
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: big}))
	var small []cuda.Ptr
	for range 6 { // three pages of small blocks, taken from big's
		small = append(small, mustMalloc(t, exp.a, 0, 700*KiB, 0))
	}
	require.Equal(t, uint64(30*MiB), exp.d.Used(0), "the small pool's pages came from the large block")
	for i, p := range small {
		record(p, 700*KiB, roundTrip(p, 700*KiB, byte(10+i)))
	}
	for _, p := range small {
		require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: p}))
	}
	// The small pool's three pages go back to the large pool.
	p := mustMalloc(t, exp.a, 0, 40*MiB, 0)
	require.Zero(t, stats(t, exp.a, 0).ReservedBytes[pools.StatSmall].Current, "the small pool's pages moved")
	require.Equal(t, int64(6), stitchStats(t, exp.a).Remaps)
	h := roundTrip(p, 40*MiB, 30)
	record(p, 40*MiB, h)
	require.Len(t, h.Segment.FDs, 20)
	require.Len(t, exp.d.OpenFDs(), len(fdOf), "one descriptor per page ever exported, held until its release")

	importsGone(t, imp)
	require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: p}))
	exp.d.CompleteAll()
	require.NoError(t, exp.a.EmptyCache(0))
	require.Empty(t, exp.d.OpenFDs())
	require.Zero(t, exp.d.Used(0))
	require.NoError(t, exp.a.CheckInvariants())
	require.Zero(t, exp.d.Violations(), "%v", exp.d.ViolationLog())
}

// A MemPool's range is not part of the page pool with stitching either
// (private pools are not: vmem/doc.go): it maps each growth as one
// allocation, 20 MiB at least, and nothing is stitched into it (its growth
// happens while allocations are routed to it, which counts as a capture).
// A block on one allocation is shared, whatever its size; a block over the
// free tail of one allocation and the next growth lies on allocations of
// two sizes, which PyTorch's handle cannot describe, and sharing it is
// refused with an error that says so.
func TestShareStitchingMemPool(t *testing.T) {
	lockThread(t)
	x := newProc(t, stitching, cuda.ShareablePOSIXFD, GiB)
	big := mustMalloc(t, x.a, 0, 30*MiB, 0)
	require.NoError(t, x.a.Free(allocator.FreeRequest{Ptr: big}))
	x.d.CompleteAll()
	inPool := func(id uint64, size uint64) cuda.Ptr {
		pool := allocator.PoolID{B: id}
		require.NoError(t, x.a.CreateOrIncrefPool(0, pool))
		done := useMemPool(t, x.a, pool)
		defer done()
		return mustMalloc(t, x.a, 0, size, 0)
	}
	one := inPool(7, 3*MiB)
	two := inPool(8, 25*MiB)
	three := inPool(7, 40*MiB) // the 16 MiB tail of one's allocation, and 24 MiB more
	require.Zero(t, stitchStats(t, x.a).Remaps, "the default pools' free pages stayed")
	_, h, _ := share(t, x.a, one)
	require.Equal(t, uint64(20*MiB), h.Segment.SegmentSize, "one allocation of the mapping unit")
	_, h, _ = share(t, x.a, two)
	require.Equal(t, uint64(26*MiB), h.Segment.SegmentSize, "one allocation, the growth's size")
	_, _, _, err := x.a.ShareIpcHandle(three)
	require.ErrorIs(t, err, allocator.ErrNotSupported)
	require.Contains(t, err.Error(), "lies on physical allocations of 20971520 and 25165824 bytes")
	require.Contains(t, err.Error(), "the block spans two growths")
	p := mustMalloc(t, x.a, 0, 4*MiB, 0)
	_, h, _ = share(t, x.a, p)
	require.Equal(t, uint64(2*MiB), h.Segment.SegmentSize, "the default pool's pages")
	for _, b := range []cuda.Ptr{one, two, three, p} {
		require.NoError(t, x.a.Free(allocator.FreeRequest{Ptr: b}))
	}
	require.NoError(t, x.a.CheckInvariants())
	require.Zero(t, x.d.Violations(), "%v", x.d.ViolationLog())
}

// Randomized, with stitching: blocks of every size on two streams are
// allocated, used by kernels of a device running behind the host, shared
// and freed while stitching moves pages (unmapped and lent) between holes,
// streams and size classes, and empty_cache runs now and then. Every block
// is shareable (the default pools' physical allocations are all one page),
// the importer reads each block's own bytes, and a handle kept while its
// block lives maps that block's memory however late it is opened.
func TestShareRandomUnderStitching(t *testing.T) {
	lockThread(t)
	ops := 4000
	if testing.Short() {
		ops = 1000
	}
	exp := newProc(t, stitching, cuda.ShareablePOSIXFD, 2*GiB)
	imp := newProc(t, "", cuda.ShareablePOSIXFD, 8*GiB)
	rng := rand.New(rand.NewSource(7))
	type live struct {
		p    cuda.Ptr
		size uint64
		tag  []byte
		raw  []byte // its handle, kept: opened again before the free
		off  uint64
	}
	var lives []live
	openAndRead := func(l live) {
		t.Helper()
		base, err := imp.a.OpenIpcHandle(0, l.raw)
		require.NoError(t, err)
		require.Equal(t, l.tag, read(t, imp.d, base+cuda.Ptr(l.off), len(l.tag)), "the importer reads the block's bytes")
		require.NoError(t, imp.a.IpcClose(base))
	}
	shared := 0
	for i := range ops {
		switch r := rng.Intn(10); {
		case len(lives) < 40 && (r < 5 || len(lives) == 0):
			size := uint64(512 * math.Pow(2, rng.Float64()*17)) // 512 B to 64 MiB, log-uniform
			s := cuda.Stream(rng.Intn(2))
			p, err := exp.a.Malloc(&allocator.MallocRequest{Size: size, Stream: s})
			if errors.Is(err, allocator.ErrOutOfMemory) {
				continue
			}
			require.NoError(t, err)
			exp.d.Use(0, s, p, size)
			l := live{p: p, size: size, tag: []byte(fmt.Sprintf("block of op %d", i))}
			require.NoError(t, exp.d.WriteDevice(0, p, l.tag))
			if rng.Intn(2) == 0 {
				raw, off, _, err := exp.a.ShareIpcHandle(p)
				require.NoError(t, err, "a block of %d bytes with stitching is shareable", size)
				l.raw, l.off = raw, off
				openAndRead(l)
				shared++
			}
			lives = append(lives, l)
		case r < 9 && len(lives) > 0:
			k := rng.Intn(len(lives))
			l := lives[k]
			if l.raw != nil {
				openAndRead(l) // late: after whatever stitching did meanwhile
			}
			require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: l.p}))
			lives[k] = lives[len(lives)-1]
			lives = lives[:len(lives)-1]
		case rng.Intn(4) == 0:
			exp.d.CompleteAll()
			require.NoError(t, exp.a.EmptyCache(0))
		default:
			exp.d.Complete(cuda.Stream(rng.Intn(2)))
		}
	}
	st := stitchStats(t, exp.a)
	require.Positive(t, st.Remaps, "stitching moved pages")
	require.Positive(t, st.Lent, "and lent some")
	require.Greater(t, shared, ops/10)
	for _, l := range lives {
		if l.raw != nil {
			openAndRead(l)
		}
		require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: l.p}))
	}
	importsGone(t, imp)
	exp.d.CompleteAll()
	require.NoError(t, exp.a.EmptyCache(0))
	require.Empty(t, exp.d.OpenFDs(), "every descriptor closed with its allocation's release")
	require.Zero(t, exp.d.Used(0))
	require.NoError(t, exp.a.CheckInvariants())
	require.Zero(t, exp.d.Violations(), "%v", exp.d.ViolationLog())
}
