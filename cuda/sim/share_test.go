// SPDX-License-Identifier: Apache-2.0

package sim_test

import (
	"fmt"
	"sync"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

// The simulator offers what the real driver offers for sharing physical
// memory.
var _ interface {
	MemCreateShareable(dev int, size uint64, kinds cuda.ShareableKind) (cuda.MemHandle, error)
	MemExportShareable(dev int, h cuda.MemHandle, kind cuda.ShareableKind) (cuda.ShareableHandle, error)
	MemImportShareable(dev int, sh cuda.ShareableHandle) (cuda.MemHandle, error)
	ShareableKinds(dev int) (cuda.ShareableKind, error)
	ProbeFabric(dev int) error
	PidfdOpen(pid int) (int, error)
	PidfdGetfd(pidfd, pid, fd int) (int, error)
	CloseFD(fd int) error
} = (*sim.Driver)(nil)

// mapNew reserves size bytes on d's device 0 and maps h there, accessible.
func mapNew(t *testing.T, d *sim.Driver, h cuda.MemHandle, size uint64) cuda.Ptr {
	t.Helper()
	p, err := d.MemAddressReserve(0, size)
	require.NoError(t, err)
	require.NoError(t, d.MemMap(0, p, size, h))
	require.NoError(t, d.MemSetAccess(0, p, size))
	return p
}

// importFD is the importer's side for a descriptor: pidfd_open, pidfd_getfd,
// import, close both descriptors.
func importFD(t *testing.T, imp *sim.Driver, pid, fd int) cuda.MemHandle {
	t.Helper()
	pfd, err := imp.PidfdOpen(pid)
	require.NoError(t, err)
	mine, err := imp.PidfdGetfd(pfd, pid, fd)
	require.NoError(t, err)
	h, err := imp.MemImportShareable(0, cuda.ShareableHandle{Kind: cuda.ShareablePOSIXFD, FD: mine})
	require.NoError(t, err)
	require.NoError(t, imp.CloseFD(mine))
	require.NoError(t, imp.CloseFD(pfd))
	return h
}

// Two processes share one physical allocation through a descriptor: the
// importer's mapping shows what the exporter wrote and the other way round,
// and the memory stays charged to the exporter's device until the importer
// has unmapped and released it too.
func TestShareDescriptorBothWays(t *testing.T) {
	exp := sim.New(sim.Options{Memory: 64 * mib})
	imp := sim.New(sim.Options{Memory: 64 * mib})
	require.NotEqual(t, exp.PID(), imp.PID())

	h, err := exp.MemCreateShareable(0, 2*gran, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	p := mapNew(t, exp, h, 2*gran)
	require.NoError(t, exp.WriteDevice(0, p+cuda.Ptr(gran)-3, []byte("across a granule")))

	sh, err := exp.MemExportShareable(0, h, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	assert.Equal(t, cuda.ShareablePOSIXFD, sh.Kind)
	assert.Equal(t, []int{sh.FD}, exp.OpenFDs())

	ih := importFD(t, imp, exp.PID(), sh.FD)
	assert.Empty(t, imp.OpenFDs(), "the importer closed what it duplicated")
	q := mapNew(t, imp, ih, 2*gran)
	got, err := imp.ReadDevice(0, q+cuda.Ptr(gran)-3, 16)
	require.NoError(t, err)
	assert.Equal(t, "across a granule", string(got))
	require.NoError(t, imp.WriteDevice(0, q, []byte("reply")))
	got, err = exp.ReadDevice(0, p, 5)
	require.NoError(t, err)
	assert.Equal(t, "reply", string(got))

	id1, off1, ok1 := exp.PhysicalAt(0, p+cuda.Ptr(gran)+7)
	id2, off2, ok2 := imp.PhysicalAt(0, q+cuda.Ptr(gran)+7)
	assert.True(t, ok1 && ok2)
	assert.Equal(t, id1, id2, "both mappings show one allocation")
	assert.Equal(t, off1, off2)
	assert.Equal(t, gran+7, off1)
	assert.Equal(t, 2*gran, exp.Used(0))
	assert.Zero(t, imp.Used(0), "imported memory is the exporter's")

	// The exporter lets go of everything; the importer still holds it.
	require.NoError(t, exp.MemUnmap(0, p, 2*gran))
	require.NoError(t, exp.MemRelease(0, h))
	require.NoError(t, exp.CloseFD(sh.FD))
	assert.Zero(t, exp.Handles(0))
	assert.Equal(t, 2*gran, exp.Used(0), "still held by the importer")
	free, _, _ := exp.MemGetInfo(0)
	assert.Equal(t, 64*mib-2*gran, free)
	got, err = imp.ReadDevice(0, q, 5)
	require.NoError(t, err)
	assert.Equal(t, "reply", string(got), "the importer's memory outlives the exporter's handle")

	// Unmapping alone does not free it; releasing does.
	require.NoError(t, imp.MemUnmap(0, q, 2*gran))
	assert.Equal(t, 2*gran, exp.Used(0))
	require.NoError(t, imp.MemRelease(0, ih))
	assert.Zero(t, exp.Used(0))
	free, _, _ = exp.MemGetInfo(0)
	assert.Equal(t, 64*mib, free)
	assert.Zero(t, exp.Violations()+imp.Violations())
}

// The same with a fabric handle, which needs no descriptor; a fabric handle
// of memory that is gone does not import.
func TestShareFabric(t *testing.T) {
	exp := sim.New(sim.Options{})
	imp := sim.New(sim.Options{})
	require.NoError(t, exp.ProbeFabric(0))
	h, err := exp.MemCreateShareable(0, gran, cuda.ShareableFabric)
	require.NoError(t, err)
	p := mapNew(t, exp, h, gran)
	require.NoError(t, exp.WriteDevice(0, p+100, []byte{1, 2, 3}))
	sh, err := exp.MemExportShareable(0, h, cuda.ShareableFabric)
	require.NoError(t, err)
	again, err := exp.MemExportShareable(0, h, cuda.ShareableFabric)
	require.NoError(t, err)
	assert.Equal(t, sh, again, "one allocation, one fabric handle")
	assert.Empty(t, exp.OpenFDs())

	ih, err := imp.MemImportShareable(0, sh)
	require.NoError(t, err)
	q := mapNew(t, imp, ih, gran)
	got, err := imp.ReadDevice(0, q+100, 3)
	require.NoError(t, err)
	assert.Equal(t, []byte{1, 2, 3}, got)

	require.NoError(t, exp.MemUnmap(0, p, gran))
	require.NoError(t, exp.MemRelease(0, h))
	assert.Equal(t, gran, exp.Used(0))
	require.NoError(t, imp.MemUnmap(0, q, gran))
	require.NoError(t, imp.MemRelease(0, ih))
	assert.Zero(t, exp.Used(0))
	_, err = imp.MemImportShareable(0, sh)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "the memory is gone")
}

// An exported descriptor holds the memory like a handle does, until closed.
func TestShareDescriptorHoldsMemory(t *testing.T) {
	d := sim.New(sim.Options{})
	h, err := d.MemCreateShareable(0, gran, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	sh, err := d.MemExportShareable(0, h, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	sh2, err := d.MemExportShareable(0, h, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	assert.NotEqual(t, sh.FD, sh2.FD, "each export opens a descriptor")
	require.NoError(t, d.MemRelease(0, h))
	assert.Equal(t, gran, d.Used(0))
	require.NoError(t, d.CloseFD(sh.FD))
	assert.Equal(t, gran, d.Used(0))
	require.NoError(t, d.CloseFD(sh2.FD))
	assert.Zero(t, d.Used(0))
	assert.ErrorIs(t, d.CloseFD(sh2.FD), syscall.EBADF)
}

// Descriptors are numbered as Linux numbers them: a closed number comes back
// for the next export, so a handle that still names it imports the new
// allocation. This is the hazard an exporter avoids by keeping its
// descriptors open while a handle naming them may be in flight.
func TestShareDescriptorNumberReuse(t *testing.T) {
	exp := sim.New(sim.Options{})
	imp := sim.New(sim.Options{})
	h1, err := exp.MemCreateShareable(0, gran, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	h2, err := exp.MemCreateShareable(0, gran, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	sh1, err := exp.MemExportShareable(0, h1, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	p1 := mapNew(t, exp, h1, gran)
	p2 := mapNew(t, exp, h2, gran)
	id1, _, _ := exp.PhysicalAt(0, p1)
	id2, _, _ := exp.PhysicalAt(0, p2)
	require.NotEqual(t, id1, id2)

	require.NoError(t, exp.CloseFD(sh1.FD))
	sh2, err := exp.MemExportShareable(0, h2, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	require.Equal(t, sh1.FD, sh2.FD, "lowest free descriptor")
	ih := importFD(t, imp, exp.PID(), sh1.FD) // a stale handle naming sh1.FD
	q := mapNew(t, imp, ih, gran)
	got, _, _ := imp.PhysicalAt(0, q)
	assert.Equal(t, id2, got, "the stale number now names the second allocation")
}

// pidfd_open and pidfd_getfd fail as the kernel does, with errors that say
// what is missing; none of them blocks.
func TestSharePidfdErrors(t *testing.T) {
	exp := sim.New(sim.Options{})
	imp := sim.New(sim.Options{})
	h, err := exp.MemCreateShareable(0, gran, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	sh, err := exp.MemExportShareable(0, h, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	pid := exp.PID()
	pfd, err := imp.PidfdOpen(pid)
	require.NoError(t, err)

	for _, c := range []struct {
		open, getfd syscall.Errno
		want        string
	}{
		{0, syscall.ENOSYS, "the kernel lacks pidfd_getfd (Linux 5.6+)"},
		{0, syscall.EPERM, fmt.Sprintf("ptrace permission to process %d is needed", pid)},
		{syscall.ENOSYS, 0, "the kernel lacks pidfd_open (Linux 5.3+)"},
	} {
		imp.SetPidfdErrors(c.open, c.getfd)
		var err error
		var pe *cuda.PidfdError
		if c.open != 0 {
			_, err = imp.PidfdOpen(pid)
		} else {
			_, err = imp.PidfdGetfd(pfd, pid, sh.FD)
		}
		require.ErrorAs(t, err, &pe)
		assert.ErrorIs(t, err, c.open|c.getfd)
		assert.Contains(t, err.Error(), c.want)
	}
	imp.SetPidfdErrors(0, 0)

	_, err = imp.PidfdGetfd(pfd, pid, sh.FD+1)
	assert.ErrorIs(t, err, syscall.EBADF, "a descriptor the exporter does not have")
	assert.Contains(t, err.Error(), "is not open in process")
	_, err = imp.PidfdGetfd(pfd+100, pid, sh.FD)
	assert.ErrorIs(t, err, syscall.EBADF, "not a pidfd")
	_, err = imp.PidfdOpen(0)
	assert.ErrorIs(t, err, syscall.EINVAL)
	_, err = imp.MemImportShareable(0, cuda.ShareableHandle{Kind: cuda.ShareablePOSIXFD, FD: pfd})
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "a pidfd is no memory")

	// The exporter exits: its process is gone, and so are its descriptors.
	exp.Exit()
	_, err = imp.PidfdOpen(pid)
	assert.ErrorIs(t, err, syscall.ESRCH)
	assert.Contains(t, err.Error(), fmt.Sprintf("process %d has exited", pid))
	_, err = imp.PidfdGetfd(pfd, pid, sh.FD)
	assert.ErrorIs(t, err, syscall.ESRCH)
	assert.Empty(t, exp.OpenFDs())
	require.NoError(t, imp.CloseFD(pfd))
}

// What cannot be created, exported or imported is refused.
func TestShareRefusals(t *testing.T) {
	d := sim.New(sim.Options{})
	plain, err := d.MemCreate(0, gran)
	require.NoError(t, err)
	_, err = d.MemExportShareable(0, plain, cuda.ShareablePOSIXFD)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "memory created without a shareable kind")
	fdOnly, err := d.MemCreateShareable(0, gran, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	_, err = d.MemExportShareable(0, fdOnly, cuda.ShareableFabric)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue)
	_, err = d.MemExportShareable(0, fdOnly, 2)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue)
	_, err = d.MemExportShareable(0, 9999, cuda.ShareablePOSIXFD)
	assert.ErrorIs(t, err, cuda.ErrInvalidHandle)
	_, err = d.MemExportShareable(1, fdOnly, cuda.ShareablePOSIXFD)
	assert.ErrorIs(t, err, cuda.ErrInvalidDevice)
	_, err = d.MemCreateShareable(0, gran, 2)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue)
	_, err = d.MemImportShareable(0, cuda.ShareableHandle{Kind: cuda.ShareablePOSIXFD, FD: 3})
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "no such descriptor")
	_, err = d.MemImportShareable(0, cuda.ShareableHandle{Kind: cuda.ShareableFabric})
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "no such fabric handle")
	_, err = d.MemImportShareable(0, cuda.ShareableHandle{Kind: 0})
	assert.ErrorIs(t, err, cuda.ErrInvalidValue)

	d.SetShareableKinds(cuda.ShareablePOSIXFD)
	k, err := d.ShareableKinds(0)
	require.NoError(t, err)
	assert.Equal(t, cuda.ShareablePOSIXFD, k)
	_, err = d.MemCreateShareable(0, gran, cuda.ShareableFabric)
	assert.ErrorIs(t, err, cuda.ErrNotPermitted, "as cuMemCreate without an IMEX channel")
	assert.ErrorIs(t, d.ProbeFabric(0), cuda.ErrNotSupported)
	assert.Equal(t, 2*gran, d.Used(0), "refusals allocate nothing")

	_, err = d.ReadDevice(0, 0x1000, 4)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "contents of unmapped memory")
	_, _, ok := d.PhysicalAt(0, 0x1000)
	assert.False(t, ok)
}

// Exporting is legal during a capture; importing is a potentially unsafe
// call, like creating.
func TestShareDuringCapture(t *testing.T) {
	d := sim.New(sim.Options{})
	th := newThread(t)
	var h, ih cuda.MemHandle
	var sh cuda.ShareableHandle
	var err error
	th.do(func() { h, err = d.MemCreateShareable(0, gran, cuda.ShareableFabric) })
	require.NoError(t, err)
	capturer := newThread(t)
	capturer.do(func() { err = d.BeginCapture(7, cuda.CaptureModeGlobal) })
	require.NoError(t, err)
	th.do(func() { sh, err = d.MemExportShareable(0, h, cuda.ShareableFabric) })
	require.NoError(t, err)
	assert.Zero(t, d.Violations())
	th.do(func() { _, err = d.MemImportShareable(0, sh) })
	require.ErrorIs(t, err, cuda.ErrCaptureUnsupported)
	assert.Equal(t, int64(1), d.Violations())
	capturer.do(func() { err = d.EndCapture(7) })
	require.ErrorIs(t, err, cuda.ErrCaptureInvalidated)
	d.ResetViolations()

	th.do(func() {
		if _, err = d.ExchangeCaptureMode(cuda.CaptureModeRelaxed); err != nil {
			return
		}
		capturer.do(func() { err = d.BeginCapture(8, cuda.CaptureModeGlobal) })
		if err == nil {
			ih, err = d.MemImportShareable(0, sh)
		}
	})
	require.NoError(t, err, "a relaxed thread may import")
	capturer.do(func() { err = d.EndCapture(8) })
	require.NoError(t, err)
	assert.Zero(t, d.Violations())
	require.NoError(t, d.MemRelease(0, ih))
}

// Processes that export to and import from each other at once neither
// deadlock nor race (run with -race), and every byte of memory is uncharged
// once all of them let go.
func TestShareConcurrentProcesses(t *testing.T) {
	const procs, rounds = 4, 25
	ds := make([]*sim.Driver, procs)
	for i := range ds {
		ds[i] = sim.New(sim.Options{Memory: gib})
	}
	var wg sync.WaitGroup
	errs := make(chan error, procs)
	for i := range ds {
		wg.Add(1)
		go func(me, peer *sim.Driver) {
			defer wg.Done()
			errs <- func() error {
				for range rounds {
					h, err := me.MemCreateShareable(0, gran, cuda.ShareablePOSIXFD|cuda.ShareableFabric)
					if err != nil {
						return err
					}
					sh, err := me.MemExportShareable(0, h, cuda.ShareablePOSIXFD)
					if err != nil {
						return err
					}
					// The peer imports our descriptor, from its side.
					pfd, err := peer.PidfdOpen(me.PID())
					if err != nil {
						return err
					}
					mine, err := peer.PidfdGetfd(pfd, me.PID(), sh.FD)
					if err != nil {
						return err
					}
					ih, err := peer.MemImportShareable(0, cuda.ShareableHandle{Kind: cuda.ShareablePOSIXFD, FD: mine})
					if err != nil {
						return err
					}
					for _, c := range []struct {
						d  *sim.Driver
						fd int
					}{{peer, mine}, {peer, pfd}, {me, sh.FD}} {
						if err := c.d.CloseFD(c.fd); err != nil {
							return err
						}
					}
					if err := me.MemRelease(0, h); err != nil {
						return err
					}
					_, _, _ = me.MemGetInfo(0)
					if err := peer.MemRelease(0, ih); err != nil {
						return err
					}
				}
				return nil
			}()
		}(ds[i], ds[(i+1)%procs])
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for i, d := range ds {
		assert.Zero(t, d.Used(0), "process %d", i)
		assert.Empty(t, d.OpenFDs(), "process %d", i)
	}
}

// RLIMIT_NOFILE: no descriptor is opened at or above the limit, and each
// call that would open one says EMFILE; a closed number below it is taken
// again.
func TestShareFDLimit(t *testing.T) {
	exp := sim.New(sim.Options{})
	imp := sim.New(sim.Options{})
	exp.SetFDLimit(5) // descriptors 3 and 4
	require.Equal(t, uint64(5), exp.FDLimit())
	var fds []int
	h, err := exp.MemCreateShareable(0, gran, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	for range 2 {
		sh, err := exp.MemExportShareable(0, h, cuda.ShareablePOSIXFD)
		require.NoError(t, err)
		fds = append(fds, sh.FD)
	}
	require.Equal(t, []int{3, 4}, fds)
	_, err = exp.MemExportShareable(0, h, cuda.ShareablePOSIXFD)
	require.ErrorIs(t, err, syscall.EMFILE)
	_, err = exp.PidfdOpen(imp.PID())
	require.ErrorIs(t, err, syscall.EMFILE)
	require.Contains(t, err.Error(), "RLIMIT_NOFILE")
	require.NoError(t, exp.CloseFD(3))
	sh, err := exp.MemExportShareable(0, h, cuda.ShareablePOSIXFD)
	require.NoError(t, err)
	require.Equal(t, 3, sh.FD)

	imp.SetFDLimit(3) // none at all
	_, err = imp.PidfdOpen(exp.PID())
	require.ErrorIs(t, err, syscall.EMFILE)
	imp.SetFDLimit(0)
	pfd, err := imp.PidfdOpen(exp.PID())
	require.NoError(t, err)
	imp.SetFDLimit(pfd + 1)
	_, err = imp.PidfdGetfd(pfd, exp.PID(), 3)
	require.ErrorIs(t, err, syscall.EMFILE)
	require.NoError(t, imp.CloseFD(pfd))
	for _, fd := range exp.OpenFDs() {
		require.NoError(t, exp.CloseFD(fd))
	}
	require.NoError(t, exp.MemRelease(0, h))
	require.Zero(t, exp.Used(0), "the failed calls took no reference")
}
