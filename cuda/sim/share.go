// SPDX-License-Identifier: Apache-2.0

package sim

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"sort"
	"sync"
	"syscall"
	"weak"

	"github.com/cudapool/cudapool/cuda"
)

// Sharing physical memory between processes, the way PyTorch shares memory
// in expandable segments: cuMemCreate with requested handle kinds,
// cuMemExportToShareableHandle, pidfd_open + pidfd_getfd to duplicate the
// exporter's descriptor, cuMemImportFromShareableHandle, and close(2).
//
// Design note. Each Driver is one process of one machine: it has a process
// id (PID) and a descriptor table, and the machine (package-level state,
// guarded by machine.mu) knows the live processes by id, the fabric handles
// exported, and every physical allocation's references. The lock order is
// Driver.mu, then machine.mu; nothing takes a Driver's mu while holding
// machine.mu, so two processes importing from each other cannot deadlock.
//
//   - A physical allocation is a *memory. Every process handle of it
//     (created or imported) and every open descriptor exported from it
//     holds one reference, as the driver counts them: cuMemRelease frees
//     the memory when "all outstanding references to the handle (including
//     its shareable counterparts)" are released and every mapping is
//     unmapped. A fabric handle holds none: importing one of memory that is
//     gone is ErrInvalidValue.
//   - The creating process's device is charged (Used, MemGetInfo) from
//     creation until the last reference anywhere goes. When its own handle
//     goes first, the memory becomes an orphan of its device, uncharged
//     lazily (settle) once the last holder lets go, since that holder, in
//     another process, cannot take the owner's lock. An importer is not
//     charged.
//   - Descriptors are numbered as Linux numbers them, lowest free first
//     (from 3), so a descriptor closed and reopened gets the same number: a
//     handle in flight that names a closed descriptor imports whatever now
//     has its number, as on Linux. Exporting twice gives two descriptors.
//   - SetFDLimit models RLIMIT_NOFILE: a descriptor that would be numbered
//     at or above it is not opened (EMFILE).
//   - pidfd_open of a process that has exited (Exit, or a Driver the
//     garbage collector took) is ESRCH; pidfd_getfd of a descriptor the
//     process does not have is EBADF. SetPidfdErrors makes either call fail
//     with any errno (ENOSYS for an old kernel, EPERM for ptrace rules).
//   - Exporting is legal during capture (no stream is involved); importing
//     is a potentially unsafe call, like MemCreate. Both are unverified on
//     a GPU in this respect.
//   - Contents follow the physical allocation, so a write through one
//     process's mapping is read through another's and bytes survive a
//     page's unmap and remap; contents.go keeps them.

// machine is the state every simulated process shares.
var machine = struct {
	mu     sync.Mutex
	procs  map[int]weak.Pointer[Driver]  // live processes by id
	fabric map[cuda.FabricHandle]*memory // fabric exports of live memory
	lastID uint64                        // physical allocations' ids
}{
	procs:  make(map[int]weak.Pointer[Driver]),
	fabric: make(map[cuda.FabricHandle]*memory),
}

// pidBase starts the simulated process ids, far above real ones.
const pidBase = 4 << 20

// memory is one physical allocation: a cuMemCreate allocation, or the
// holder of a MemAlloc allocation's contents (contents.go), which no other
// process sees.
type memory struct {
	id    uint64
	owner *Driver // the creating process, whose device dev is charged
	dev   int
	size  uint64
	kinds cuda.ShareableKind

	// The fields below are guarded by machine.mu.
	refs      int  // handles of every process not yet freed, and open descriptors
	gone      bool // refs reached zero
	hasFabric bool
	fabric    cuda.FabricHandle
	data      pages // contents (contents.go); nil until first written
	copies    int   // queued copies that read or write data
}

// fdEntry is an open descriptor: an export of mem, or a pidfd of pid.
type fdEntry struct {
	mem *memory
	pid int
}

// fabricMagic starts every simulated fabric handle.
const fabricMagic = "cudapool-sim-fab"

func newMemory(owner *Driver, dev int, size uint64, kinds cuda.ShareableKind) *memory {
	machine.mu.Lock()
	defer machine.mu.Unlock()
	machine.lastID++
	return &memory{id: machine.lastID, owner: owner, dev: dev, size: size, kinds: kinds, refs: 1}
}

// unref drops one reference; machine.mu must be held. It reports whether
// the memory is gone; its contents go with it, or with the last queued
// copy that reads or writes them (contents.go).
func (m *memory) unref() bool {
	m.refs--
	if m.refs > 0 {
		return false
	}
	m.gone = true
	if m.copies == 0 {
		m.data = nil
	}
	if m.hasFabric {
		delete(machine.fabric, m.fabric)
	}
	return true
}

// register makes d a live process of the machine, until Exit or until the
// garbage collector takes d.
func (d *Driver) register() {
	machine.mu.Lock()
	defer machine.mu.Unlock()
	d.pid = pidBase + int(d.instance)
	machine.procs[d.pid] = weak.Make(d)
	runtime.AddCleanup(d, func(pid int) {
		machine.mu.Lock()
		defer machine.mu.Unlock()
		delete(machine.procs, pid)
	}, d.pid)
}

// PID returns this simulated process's id, which PidfdOpen of another
// Driver accepts.
func (d *Driver) PID() int { return d.pid }

// Exit makes this process exit as far as the others can tell: its id is no
// longer a process (pidfd_open and pidfd_getfd say ESRCH) and its
// descriptors are closed. Its handles and mappings stay as they are, for a
// test to release or keep.
func (d *Driver) Exit() {
	machine.mu.Lock()
	defer machine.mu.Unlock()
	delete(machine.procs, d.pid)
	for fd, e := range d.fds {
		delete(d.fds, fd)
		if e.mem != nil {
			e.mem.unref()
		}
	}
}

// process returns the live process pid; machine.mu must be held.
func process(pid int) *Driver {
	if w, ok := machine.procs[pid]; ok {
		return w.Value()
	}
	return nil
}

// newFD enters e in d's descriptor table at the lowest free number from 3,
// or reports false if that number is not below the limit (SetFDLimit), as
// Linux fails with EMFILE; machine.mu must be held.
func (d *Driver) newFD(e *fdEntry) (int, bool) {
	fd := 3
	for d.fds[fd] != nil {
		fd++
	}
	if d.fdLimit > 0 && fd >= d.fdLimit {
		return -1, false
	}
	d.fds[fd] = e
	return fd, true
}

// SetFDLimit sets this process's limit of open descriptors (RLIMIT_NOFILE):
// no descriptor numbered n or above is opened, and the calls that would
// open one fail with EMFILE (an export with syscall.EMFILE itself; what
// the real driver answers then is not verified). 0: no limit.
func (d *Driver) SetFDLimit(n int) {
	machine.mu.Lock()
	defer machine.mu.Unlock()
	d.fdLimit = n
}

// FDLimit returns the limit SetFDLimit set, 0 for none.
func (d *Driver) FDLimit() uint64 {
	machine.mu.Lock()
	defer machine.mu.Unlock()
	return uint64(d.fdLimit)
}

// dropPhysical gives up ph, one of dv's handles that is now both released
// and unmapped; d.mu must be held.
func (d *Driver) dropPhysical(dv *device, ph *physical) {
	machine.mu.Lock()
	last := ph.mem.unref()
	machine.mu.Unlock()
	if ph.imported {
		return // the creating process is charged, and settles
	}
	if last {
		dv.used -= ph.size
		return
	}
	dv.orphans = append(dv.orphans, ph.mem)
}

// settle uncharges dv's orphans that the last holder has let go of; d.mu
// must be held.
func (d *Driver) settle(dv *device) {
	if len(dv.orphans) == 0 {
		return
	}
	machine.mu.Lock()
	defer machine.mu.Unlock()
	kept := dv.orphans[:0]
	for _, m := range dv.orphans {
		if m.gone {
			dv.used -= m.size
		} else {
			kept = append(kept, m)
		}
	}
	clear(dv.orphans[len(kept):])
	dv.orphans = kept
}

// SetShareableKinds sets the handle kinds the devices can export (by
// default file descriptors and fabric handles). MemCreateShareable with any
// other kind fails with ErrNotPermitted; ShareableKinds reports these.
func (d *Driver) SetShareableKinds(kinds cuda.ShareableKind) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.shareKinds = kinds
}

// ShareableKinds returns the handle kinds dev can export.
func (d *Driver) ShareableKinds(dev int) (cuda.ShareableKind, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return 0, err
	}
	return d.shareKinds, nil
}

// ProbeFabric reports whether fabric handles work on dev: nil if
// SetShareableKinds allows them.
func (d *Driver) ProbeFabric(dev int) error {
	kinds, err := d.ShareableKinds(dev)
	if err != nil {
		return err
	}
	if kinds&cuda.ShareableFabric == 0 {
		return fmt.Errorf("sim: device %d does not support fabric handles: %w", dev, cuda.ErrNotSupported)
	}
	return nil
}

// MemExportShareable exports dev's handle h as one handle of kind, which h's
// memory must have been created with: a new descriptor of this process
// (which holds a reference to the memory until CloseFD), or the memory's
// fabric handle (the same one each time). It is legal during capture.
func (d *Driver) MemExportShareable(dev int, h cuda.MemHandle, kind cuda.ShareableKind) (cuda.ShareableHandle, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return cuda.ShareableHandle{}, err
	}
	ph := dv.vmm.handles[h]
	if ph == nil {
		return cuda.ShareableHandle{}, cuda.ErrInvalidHandle
	}
	if (kind != cuda.ShareablePOSIXFD && kind != cuda.ShareableFabric) || ph.mem.kinds&kind == 0 {
		return cuda.ShareableHandle{}, cuda.ErrInvalidValue
	}
	machine.mu.Lock()
	defer machine.mu.Unlock()
	m := ph.mem
	if kind == cuda.ShareablePOSIXFD {
		fd, ok := d.newFD(&fdEntry{mem: m})
		if !ok {
			return cuda.ShareableHandle{}, syscall.EMFILE
		}
		m.refs++
		return cuda.ShareableHandle{Kind: kind, FD: fd}, nil
	}
	if !m.hasFabric {
		copy(m.fabric[:16], fabricMagic)
		binary.LittleEndian.PutUint64(m.fabric[16:], m.id)
		binary.LittleEndian.PutUint64(m.fabric[24:], m.owner.instance)
		m.hasFabric = true
		machine.fabric[m.fabric] = m
	}
	return cuda.ShareableHandle{Kind: kind, FD: -1, Fabric: m.fabric}, nil
}

// MemImportShareable imports memory another process (or this one) exported:
// a descriptor of this process (from PidfdGetfd, or an export) or a fabric
// handle of live memory. The new handle is this process's to map and to
// release; the memory is not charged to dev (the simulator does not check
// that dev is the device the memory is on). Anything else is
// ErrInvalidValue. It is a potentially unsafe call.
func (d *Driver) MemImportShareable(dev int, sh cuda.ShareableHandle) (cuda.MemHandle, error) {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return 0, err
	}
	if sh.Kind != cuda.ShareablePOSIXFD && sh.Kind != cuda.ShareableFabric {
		return 0, cuda.ErrInvalidValue
	}
	if err := d.checkUnsafe(tid, fmt.Sprintf("MemImportShareable(dev=%d, kind=%v)", dev, sh.Kind)); err != nil {
		return 0, err
	}
	machine.mu.Lock()
	var m *memory
	if sh.Kind == cuda.ShareablePOSIXFD {
		if e := d.fds[sh.FD]; e != nil {
			m = e.mem
		}
	} else {
		m = machine.fabric[sh.Fabric]
	}
	if m == nil || m.gone || m.kinds&sh.Kind == 0 {
		machine.mu.Unlock()
		return 0, cuda.ErrInvalidValue
	}
	m.refs++
	machine.mu.Unlock()
	d.lastHandle++
	dv.vmm.handles[d.lastHandle] = &physical{size: m.size, mem: m, imported: true}
	return d.lastHandle, nil
}

// SetPidfdErrors makes every later PidfdOpen fail with open and every later
// PidfdGetfd with getfd (0: work normally): syscall.ENOSYS models a kernel
// older than 5.3 or 5.6, syscall.EPERM a ptrace rule that forbids it.
func (d *Driver) SetPidfdErrors(open, getfd syscall.Errno) {
	machine.mu.Lock()
	defer machine.mu.Unlock()
	d.pidfdErrs = [2]syscall.Errno{open, getfd}
}

// PidfdOpen returns a descriptor of this process that refers to process
// pid (pidfd_open).
func (d *Driver) PidfdOpen(pid int) (int, error) {
	machine.mu.Lock()
	defer machine.mu.Unlock()
	fail := func(e syscall.Errno) (int, error) {
		return -1, &cuda.PidfdError{Call: "pidfd_open", PID: pid, FD: -1, Errno: e}
	}
	if e := d.pidfdErrs[0]; e != 0 {
		return fail(e)
	}
	if pid <= 0 {
		return fail(syscall.EINVAL)
	}
	if process(pid) == nil {
		return fail(syscall.ESRCH)
	}
	fd, ok := d.newFD(&fdEntry{pid: pid})
	if !ok {
		return fail(syscall.EMFILE)
	}
	return fd, nil
}

// PidfdGetfd duplicates descriptor fd of the process pidfd refers to into
// this process (pidfd_getfd); pid names that process in errors.
func (d *Driver) PidfdGetfd(pidfd, pid, fd int) (int, error) {
	machine.mu.Lock()
	defer machine.mu.Unlock()
	fail := func(e syscall.Errno) (int, error) {
		return -1, &cuda.PidfdError{Call: "pidfd_getfd", PID: pid, FD: fd, Errno: e}
	}
	if e := d.pidfdErrs[1]; e != 0 {
		return fail(e)
	}
	pe := d.fds[pidfd]
	if pe == nil || pe.pid == 0 {
		return fail(syscall.EBADF)
	}
	pid = pe.pid
	src := process(pid)
	if src == nil {
		return fail(syscall.ESRCH)
	}
	e := src.fds[fd]
	if e == nil {
		return fail(syscall.EBADF)
	}
	nfd, ok := d.newFD(&fdEntry{mem: e.mem, pid: e.pid})
	if !ok {
		return fail(syscall.EMFILE)
	}
	if e.mem != nil {
		e.mem.refs++
	}
	return nfd, nil
}

// CloseFD closes a descriptor of this process; an export's descriptor drops
// its reference to the memory.
func (d *Driver) CloseFD(fd int) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	machine.mu.Lock()
	e := d.fds[fd]
	if e == nil {
		machine.mu.Unlock()
		return syscall.EBADF
	}
	delete(d.fds, fd)
	if e.mem != nil {
		e.mem.unref()
	}
	machine.mu.Unlock()
	for _, dv := range d.devs {
		d.settle(dv)
	}
	return nil
}

// OpenFDs returns the numbers of this process's open descriptors, in order.
func (d *Driver) OpenFDs() []int {
	machine.mu.Lock()
	defer machine.mu.Unlock()
	fds := make([]int, 0, len(d.fds))
	for fd := range d.fds {
		fds = append(fds, fd)
	}
	sort.Ints(fds)
	return fds
}
