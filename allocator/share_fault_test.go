// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
)

// Driver faults at every call site of sharing memory with other processes:
// the exporter's (vmem/export.go, the shareable creation in mapper.go) and
// the importer's (vmem/shareimport.go's ImportCache, reached through
// OpenIpcHandle and IpcClose). They join faultCases, which
// TestFaultCallSitesCovered checks against the source.

func init() {
	for k, c := range shareFaultCases {
		faultCases[k] = c
	}
}

// shareFault is newFault with the simulator's memory shareable through
// kinds.
func shareFault(t *testing.T, conf string, kinds cuda.ShareableKind) *fenv {
	e := newFault(t, conf, false)
	e.sim().SetShareableKinds(kinds)
	return e
}

// importScene is an exporter (a plain simulated process, page by page, so
// that a 5 MiB block lies on three physical allocations) whose block's
// handle the fault-injecting importer e opens; want is the block's bytes.
type importScene struct {
	e    *fenv
	exp  proc
	p    cuda.Ptr
	raw  []byte
	off  uint64
	want []byte
}

func newImportScene(t *testing.T, kinds cuda.ShareableKind) *importScene {
	s := &importScene{e: newFault(t, confOrdinary, false), exp: newProc(t, stitch, kinds, GiB)}
	s.p = mustMalloc(t, s.exp.a, 0, 5*MiB, 0)
	s.want = fill(t, s.exp.d, s.p, 5*MiB, 42)
	s.raw, _, s.off = share(t, s.exp.a, s.p)
	return s
}

// opens requires that the handle opens now and shows the block, and closes
// it.
func (s *importScene) opens() {
	t := s.e.t
	t.Helper()
	base, err := s.e.a.OpenIpcHandle(0, s.raw)
	require.NoError(t, err)
	require.Equal(t, s.want, read(t, s.e.sim(), base+cuda.Ptr(s.off), 5*MiB))
	require.NoError(t, s.e.a.IpcClose(base))
}

// clean requires that the importer holds nothing of the import (no
// mapping, reservation, handle or descriptor) and that the allocator lost
// nothing.
func (s *importScene) clean() {
	t := s.e.t
	t.Helper()
	n, refs, reserved := s.e.a.ImportStats()
	require.Zero(t, n+refs)
	require.Zero(t, reserved)
	require.Zero(t, s.e.sim().Mapped(0))
	require.Empty(t, s.e.sim().OpenFDs())
	s.e.nothingLost()
}

var shareFaultCases = map[string]faultCase{
	// Exporter: the creation of shareable memory fails part way, as
	// MemCreate's case.
	"vmem/mapper.go:(*Space).create.MemCreateShareable": {run: func(t *testing.T) {
		e := shareFault(t, confPages, cuda.ShareablePOSIXFD)
		r := e.fail("MemCreateShareable", "", 1)
		_, err := e.a.Malloc(&allocator.MallocRequest{Size: 5 * MiB, Stream: 1})
		e.fired(r)
		e.driverErr(err, "malloc", "mapping memory for a 5242880-byte block")
		require.Zero(t, e.sim().Handles(0))
		e.consistent(0)
		p := e.malloc(5*MiB, 1)
		_, h, _ := share(t, e.a, p)
		require.Len(t, h.Segment.FDs, 3)
		require.Zero(t, e.f.Calls("MemCreate"), "every allocation shareable")
		e.nothingLost()
		require.Empty(t, e.sim().OpenFDs())
	}},
	// Which kinds the device exports cannot be read: memory is made as
	// without sharing, and an export says why it cannot be.
	"vmem/export.go:(*Space).chooseKind.ShareableKinds": {run: func(t *testing.T) {
		e := shareFault(t, confExpandable, cuda.ShareablePOSIXFD)
		r := e.fail("ShareableKinds", "", 0)
		p := e.malloc(3*MiB, 1)
		e.fired(r)
		require.Positive(t, e.f.Calls("MemCreate"))
		_, _, _, err := e.a.ShareIpcHandle(p)
		require.ErrorIs(t, err, allocator.ErrNotSupported)
		require.Contains(t, err.Error(), "reading which handle kinds device 0 can export failed (CUDA_ERROR_UNKNOWN")
		e.consistent(0)
		e.nothingLost()
	}},
	// The fabric probe fails: file descriptors, as PyTorch falls back.
	"vmem/export.go:(*Space).chooseKind.ProbeFabric": {run: func(t *testing.T) {
		e := shareFault(t, confExpandable, cuda.ShareablePOSIXFD|cuda.ShareableFabric)
		r := e.fail("ProbeFabric", "", 0)
		p := e.malloc(3*MiB, 1)
		e.fired(r)
		_, h, _ := share(t, e.a, p)
		require.Equal(t, cuda.ShareablePOSIXFD, h.Segment.Kind)
		e.nothingLost()
		require.Empty(t, e.sim().OpenFDs())
	}},
	// The export fails: the error says which allocation; nothing is
	// cached, and the next export works.
	"vmem/export.go:(*Space).Share.MemExportShareable": {run: func(t *testing.T) {
		e := shareFault(t, confPages, cuda.ShareablePOSIXFD)
		p := e.malloc(5*MiB, 1)
		r := e.fail("MemExportShareable", "", 1)
		_, _, _, err := e.a.ShareIpcHandle(p)
		e.fired(r)
		e.driverErr(err, "ipc_share", "exporting physical allocation 2 of 3 on device 0 as a posix-fd handle (exported memory holds 1 file descriptors")
		require.Len(t, e.sim().OpenFDs(), 1, "the first one's export stays with it")
		_, h, _ := share(t, e.a, p)
		require.Len(t, h.Segment.FDs, 3)
		require.Len(t, e.sim().OpenFDs(), 3)
		e.consistent(0)
		e.nothingLost()
		require.Empty(t, e.sim().OpenFDs())
	}},
	// A descriptor that does not close when its allocation is released is
	// reported (its memory stays until the process exits).
	"vmem/export.go:(*Space).released.CloseFD": {run: func(t *testing.T) {
		e := shareFault(t, confExpandable, cuda.ShareablePOSIXFD)
		p := e.malloc(3*MiB, 1)
		_, h, _ := share(t, e.a, p)
		e.free(p)
		r := e.fail("CloseFD", "released", 0)
		require.NoError(t, e.a.EmptyCache(0))
		e.fired(r)
		require.Len(t, e.warnings, 1)
		require.Contains(t, e.warnings[0], "closing file descriptor")
		require.Contains(t, e.warnings[0], "its memory stays allocated until the process exits")
		n, fds, err := e.a.ExportStats(0)
		require.NoError(t, err)
		require.Zero(t, n+fds, "forgotten all the same")
		require.Equal(t, uint64(20*MiB), e.sim().Used(0), "held by the open descriptor")
		require.NoError(t, e.sim().CloseFD(int(h.Segment.FDs[0])))
		e.nothingLost()
	}},

	// Importer.
	"vmem/shareimport.go:(*ImportCache).Open.MemGranularity": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		r := s.e.fail("MemGranularity", "ImportCache", 0)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_open_shared", "the device's granularity")
		s.opens()
		s.clean()
	}},
	"vmem/shareimport.go:(*ImportCache).importHandles.MemImportShareable": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD|cuda.ShareableFabric)
		r := s.e.fail("MemImportShareable", "ImportCache", 1)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_open_shared", "importing fabric handle 2 of 3")
		require.Zero(t, s.e.sim().Handles(0), "the first import was released")
		s.opens()
		s.clean()
	}},
	"vmem/shareimport.go:(*ImportCache).importHandles.PidfdOpen": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		r := s.e.fail("PidfdOpen", "ImportCache", 0)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_open_shared", "importing memory shared by process")
		s.opens()
		s.clean()
	}},
	// Closing the pidfd fails: the import stands (Linux frees a descriptor
	// whatever close returns; here it stays open, and is closed by hand).
	"vmem/shareimport.go:(*ImportCache).importHandles.CloseFD": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		r := s.e.fail("CloseFD", "importHandles", 3) // the three copies first, then the pidfd
		s.opens()
		s.e.fired(r)
		fds := s.e.sim().OpenFDs()
		require.Len(t, fds, 1)
		require.NoError(t, s.e.sim().CloseFD(fds[0]))
		s.clean()
	}},
	"vmem/shareimport.go:(*ImportCache).importHandles.PidfdGetfd": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		r := s.e.fail("PidfdGetfd", "ImportCache", 1)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_open_shared", "importing memory shared by process")
		require.Zero(t, s.e.sim().Handles(0), "the first import was released")
		require.Empty(t, s.e.sim().OpenFDs())
		s.opens()
		s.clean()
	}},
	"vmem/shareimport.go:(*ImportCache).importHandles.MemImportShareable#2": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		r := s.e.fail("MemImportShareable", "ImportCache", 2)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_open_shared", "(3 of 3) of process")
		require.Zero(t, s.e.sim().Handles(0), "the first two imports were released")
		require.Empty(t, s.e.sim().OpenFDs(), "and every copied descriptor closed")
		s.opens()
		s.clean()
	}},
	"vmem/shareimport.go:(*ImportCache).importHandles.CloseFD#2": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		r := s.e.fail("CloseFD", "importHandles", 1)
		s.opens()
		s.e.fired(r)
		fds := s.e.sim().OpenFDs()
		require.Len(t, fds, 1, "the copy that did not close")
		require.NoError(t, s.e.sim().CloseFD(fds[0]))
		s.clean()
	}},
	"vmem/shareimport.go:(*ImportCache).mapAll.MemAddressReserve": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		r := s.e.fail("MemAddressReserve", "ImportCache", 0)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_open_shared", "reserving 6291456 bytes of address space for an import")
		require.Zero(t, s.e.sim().Handles(0))
		s.opens()
		s.clean()
	}},
	"vmem/shareimport.go:(*ImportCache).mapAll.MemMap": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		r := s.e.fail("MemMap", "ImportCache", 1)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_open_shared", "mapping allocation 2 of 3 of an import")
		require.Zero(t, s.e.sim().Mapped(0), "the first mapping was undone")
		require.Zero(t, s.e.sim().Handles(0))
		s.opens()
		s.clean()
	}},
	"vmem/shareimport.go:(*ImportCache).mapAll.MemSetAccess": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		r := s.e.fail("MemSetAccess", "ImportCache", 0)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_open_shared", "granting access of an import")
		require.Zero(t, s.e.sim().Mapped(0))
		require.Zero(t, s.e.sim().Handles(0))
		s.opens()
		s.clean()
	}},
	// Undoing a failed import fails too: the error says what stays (a
	// mapping, and so its reservation).
	"vmem/shareimport.go:(*ImportCache).mapAll.MemUnmap": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		s.e.fail("MemSetAccess", "ImportCache", 0)
		r := s.e.fail("MemUnmap", "ImportCache", 0)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_open_shared", "granting access of an import")
		require.Contains(t, err.Error(), "undoing it failed too: unmapping allocation 3")
		require.Contains(t, err.Error(), "freeing the 6291456-byte address range")
		require.Equal(t, uint64(2*MiB), s.e.sim().Mapped(0), "the mapping that stays")
		s.opens()
	}},
	"vmem/shareimport.go:(*ImportCache).mapAll.MemAddressFree": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		s.e.fail("MemSetAccess", "ImportCache", 0)
		r := s.e.fail("MemAddressFree", "ImportCache", 0)
		_, err := s.e.a.OpenIpcHandle(0, s.raw)
		s.e.fired(r)
		require.Contains(t, err.Error(), "undoing it failed too: freeing the 6291456-byte address range")
		require.Zero(t, s.e.sim().Mapped(0))
		n, _ := s.e.sim().Reservations(0)
		require.Equal(t, 1, n, "the reservation that stays")
		s.opens()
	}},
	// The last close fails at each step: every step is tried, and the
	// error names each that failed; the import is forgotten.
	"vmem/shareimport.go:(*ImportCache).releaseHandles.MemRelease": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		base, err := s.e.a.OpenIpcHandle(0, s.raw)
		require.NoError(t, err)
		r := s.e.fail("MemRelease", "ImportCache", 1)
		err = s.e.a.IpcClose(base)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_close", "releasing imported allocation 2 of 3")
		require.Equal(t, 1, s.e.sim().Handles(0), "the handle that stays")
		require.ErrorIs(t, s.e.a.IpcClose(base), allocator.ErrUnknownPointer, "forgotten")
		s.opens()
	}},
	"vmem/shareimport.go:(*ImportCache).unmap.DeviceSynchronize": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		base, err := s.e.a.OpenIpcHandle(0, s.raw)
		require.NoError(t, err)
		r := s.e.fail("DeviceSynchronize", "ImportCache", 0)
		err = s.e.a.IpcClose(base)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_close", "synchronising device 0")
		s.clean()
	}},
	"vmem/shareimport.go:(*ImportCache).unmap.MemUnmap": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		base, err := s.e.a.OpenIpcHandle(0, s.raw)
		require.NoError(t, err)
		r := s.e.fail("MemUnmap", "ImportCache", 0)
		err = s.e.a.IpcClose(base)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_close", "unmapping")
		require.Contains(t, err.Error(), "freeing the reservation at", "which the mapping holds")
		require.Equal(t, uint64(6*MiB), s.e.sim().Mapped(0), "the mapping that stays")
		require.Equal(t, 3, s.e.sim().Handles(0), "released, held by the mapping")
		s.opens()
	}},
	"vmem/shareimport.go:(*ImportCache).unmap.MemAddressFree": {run: func(t *testing.T) {
		s := newImportScene(t, cuda.ShareablePOSIXFD)
		base, err := s.e.a.OpenIpcHandle(0, s.raw)
		require.NoError(t, err)
		r := s.e.fail("MemAddressFree", "ImportCache", 0)
		err = s.e.a.IpcClose(base)
		s.e.fired(r)
		s.e.driverErr(err, "ipc_close", "freeing the reservation at")
		require.Zero(t, s.e.sim().Mapped(0))
		require.Zero(t, s.e.sim().Handles(0))
		n, _ := s.e.sim().Reservations(0)
		require.Equal(t, 1, n, "the reservation that stays")
		s.opens()
	}},
}
