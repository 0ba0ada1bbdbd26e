// SPDX-License-Identifier: Apache-2.0

// Package sim is a simulated CUDA driver that enforces the rules of stream
// capture, so that cudapool's allocator can be tested on machines with no GPU.
//
// Why it exists: the allocator's subtlest bugs are in how it behaves while a
// stream is being captured into a CUDA graph. One cudaMalloc, event query or
// free in the wrong place invalidates the user's capture, and on a real GPU
// that shows up far from its cause, if at all. The simulator refuses every such
// call the way CUDA does and also records it, so a test can assert that there
// were none.
//
// What it models:
//   - Devices with a fixed capacity, memory held by "another process"
//     (SetExternalUse) and injected allocation failures (FailAllocs). Addresses
//     are fake: device d's allocations come from a bump pointer starting at
//     (d+1)<<44, aligned to 2 MiB, never overlapping and never reused, so a
//     stale pointer is always detected as unknown.
//   - Streams as two counters, work submitted and work completed. Work
//     completes only when the test says so (Submit, Complete, CompleteAll) or
//     when a synchronising call models waiting, which makes event order
//     deterministic. Any cuda.Stream value is a stream; 0 is the legacy one.
//     The application may destroy one of its streams (DestroyStream): CUDA's
//     behaviour is undefined when a destroyed stream's handle is used again
//     (the driver reads the freed stream: a crash, or another stream), so
//     every later call that names it is refused and logged as a violation.
//   - Events, which snapshot their stream's submitted count when recorded.
//   - Stream capture and per-thread capture modes, as documented for
//     cudaStreamCaptureMode and cudaThreadExchangeStreamCaptureMode: a thread
//     in Global mode may not make a potentially unsafe call while any Global
//     capture is in progress, or while it has a non-relaxed capture of its own;
//     a ThreadLocal thread only while it has a non-relaxed capture of its own;
//     a Relaxed thread always may. The potentially unsafe calls are MemAlloc,
//     EventQuery, EventSynchronize and DeviceSynchronize. MemFree is refused
//     during any capture whatever the modes: the allocator promises never to
//     free then. A refused call does nothing, returns ErrCaptureUnsupported,
//     invalidates the captures that caused the refusal and is logged as a
//     violation. Querying or synchronising an event last recorded on a
//     capturing stream fails with ErrCapturedEvent and is a violation too.
//
// Threads are OS threads, identified with syscall.Gettid, as in CUDA: a caller
// of ExchangeCaptureMode, BeginCapture, EndCapture or a potentially unsafe call
// must have its goroutine locked to its OS thread (runtime.LockOSThread), or
// the mode it set and the captures it began may belong to another thread by the
// time it makes its next call. The package is Linux-only for that reason.
//
// Captured work is recorded as graph nodes, and streams fork into and join a
// capture through events (StreamWaitEvent), in graph.go; graphs are never
// replayed.
//
// Memory contents are modelled in contents.go, always on and free until
// something writes: the bytes of each physical allocation (device or pinned
// host), written and read by tests as a kernel or the CPU would, moved by
// asynchronous copies when their streams complete them, shared by every
// process that maps the allocation, and lost with its last reference.
//
// What it does not model: kernels, replay, cross-stream
// dependencies outside capture (StreamWaitEvent between streams that do not
// capture has no effect), the legacy stream's implicit synchronisation
// (ErrCaptureImplicit), contexts and the current device, streams belonging
// to devices, and timing.
//
// The virtual memory management API (cuMemAddressReserve, cuMemCreate,
// cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree) is
// modelled in vmm.go: granularity, reserved and mapped ranges, physical
// memory counted against capacity, and the same capture rules (creating,
// mapping and setting access are potentially unsafe like MemAlloc; unmapping,
// releasing and freeing an address range during any capture are refused like
// MemFree).
//
// CUDA IPC of memory (cuIpcGetMemHandle, cuIpcOpenMemHandle,
// cuIpcCloseMemHandle) is modelled in ipc.go: handles that name a live
// allocation and detect stale ones, reference-counted mappings that alias the
// exported memory, and a violation for freeing memory whose IPC mapping is
// still open.
//
// Sharing physical memory between processes (cuMemCreate with shareable
// handle kinds, cuMemExportToShareableHandle, pidfd_open + pidfd_getfd,
// cuMemImportFromShareableHandle), the mechanism of PyTorch's IPC of
// expandable segments, is modelled in share.go: each Driver is a process
// with an id and a descriptor table, and physical memory is reference
// counted across processes, so that its contents (contents.go) show through
// every process's mapping.
package sim

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"syscall"

	"github.com/cudapool/cudapool/cuda"
)

const (
	defaultMemory = 80 << 30
	// allocAlign is cuMemAlloc's alignment for large sizes.
	allocAlign = 2 << 20
	// rangeShift sizes each device's address range (16 TiB), far beyond any
	// capacity, so that ranges of different devices can never meet.
	rangeShift = 44
	// maxDevices keeps the end of the last device's range inside 64 bits.
	maxDevices = 1<<(64-rangeShift) - 2
	// ExternalPID is the PID DeviceProcesses gives the "other process" whose
	// memory SetExternalUse sets.
	ExternalPID = 4242
)

// Options configures New. Zero fields take their defaults.
type Options struct {
	// Devices is the number of devices (default 1).
	Devices int
	// Memory is each device's capacity in bytes (default 80 GiB).
	Memory uint64
}

// Driver is the simulated driver. It implements allocator.Driver and
// DeviceProcesses. All methods are safe for concurrent use.
type Driver struct {
	mu sync.Mutex

	devs []*device // length fixed by New; each device's fields guarded by mu

	streams map[cuda.Stream]*stream // guarded by mu; created on first use
	events  map[cuda.Event]*event   // guarded by mu; live events only

	lastEvent  cuda.Event     // guarded by mu; handles are never reused
	lastHandle cuda.MemHandle // guarded by mu; handles are never reused
	lastIpcGen uint64         // guarded by mu; IPC handle generations (ipc.go)
	instance   uint64         // this Driver's number, in its IPC handles
	pid        int            // this "process"'s id (share.go)

	// shareKinds are the handle kinds physical memory may be created
	// shareable with (SetShareableKinds); guarded by mu.
	shareKinds cuda.ShareableKind
	// fds is this process's descriptor table and pidfdErrs the pidfd
	// failures a test injected (share.go); both guarded by machine.mu.
	fds           map[int]*fdEntry
	pidfdErrs     [2]syscall.Errno
	fdLimit       int   // SetFDLimit; guarded by machine.mu
	eventsCreated int64 // guarded by mu
	eventsGone    int64 // guarded by mu

	// captures holds the capture sequences begun and not yet ended, active or
	// invalidated, by stream.
	captures    map[cuda.Stream]*capture // guarded by mu
	lastCapture uint64                   // guarded by mu; ids start at 1
	// joined holds the streams that joined a capture begun on another
	// stream (graph.go), by stream; they are not in captures.
	joined   map[cuda.Stream]*capture // guarded by mu
	lastNode cuda.GraphNode           // guarded by mu; graph node handles

	// modes is each OS thread's capture mode; a thread with no entry is in
	// Global mode, CUDA's default.
	modes map[int]cuda.CaptureMode // guarded by mu

	violations   int64    // guarded by mu
	violationLog []string // guarded by mu

	cp copyState // guarded by mu; pinned host memory and copies (copy.go)
}

type device struct {
	capacity uint64
	external uint64 // bytes held by another process
	used     uint64 // sum of live allocations' requested sizes

	// next is the bump pointer; limit ends the device's address range.
	next, limit uint64

	live       map[cuda.Ptr]uint64 // live allocations and their sizes
	allocs     int64
	frees      int64
	failAllocs int // MemAlloc and MemCreate calls still to fail

	// allocMem holds the contents of live allocations, each made when
	// first touched (contents.go).
	allocMem map[cuda.Ptr]*memory

	vmm vmmState // virtual memory management (vmm.go)
	ipc ipcState // CUDA IPC (ipc.go)

	// orphans is memory of this device whose own handles are gone while
	// another process still holds it; it stays in used until its last
	// holder lets go (share.go).
	orphans []*memory
}

// free is what MemGetInfo reports, clamped at zero because external use may
// be set beyond what is left.
func (dv *device) free() uint64 {
	if dv.used+dv.external >= dv.capacity {
		return 0
	}
	return dv.capacity - dv.used - dv.external
}

type stream struct {
	submitted, completed uint64
	destroyed            bool // DestroyStream, or StreamDestroy of a stream StreamCreate made
}

type event struct {
	dev    int
	s      cuda.Stream
	target uint64 // complete when s's completed count reaches it
	// captureID is the capture the event was last recorded in; zero if it was
	// last recorded outside capture (or never).
	captureID uint64
	// nodes are the recording stream's terminals when recorded in capture.
	nodes []cuda.GraphNode
}

type capture struct {
	id          uint64
	s           cuda.Stream
	mode        cuda.CaptureMode
	tid         int // the OS thread that began it
	invalidated bool
	g           *graph // the work captured so far (graph.go)
}

func (c *capture) String() string {
	return fmt.Sprintf("capture %d (stream %#x, mode %v, thread %d)", c.id, uintptr(c.s), c.mode, c.tid)
}

// New returns a driver with opts.Devices idle devices and no captures.
func New(opts Options) *Driver {
	if opts.Devices <= 0 {
		opts.Devices = 1
	}
	if opts.Devices > maxDevices {
		panic(fmt.Sprintf("sim: %d devices do not fit the address space", opts.Devices))
	}
	if opts.Memory == 0 {
		opts.Memory = defaultMemory
	}
	d := &Driver{
		streams:  make(map[cuda.Stream]*stream),
		events:   make(map[cuda.Event]*event),
		captures: make(map[cuda.Stream]*capture),
		joined:   make(map[cuda.Stream]*capture),
		modes:    make(map[int]cuda.CaptureMode),
		instance: instances.Add(1),

		shareKinds: cuda.ShareablePOSIXFD | cuda.ShareableFabric,
		fds:        make(map[int]*fdEntry),
	}
	for i := range opts.Devices {
		base := uint64(i+1) << rangeShift
		d.devs = append(d.devs, &device{
			capacity: opts.Memory,
			next:     base,
			limit:    base + 1<<rangeShift,
			live:     make(map[cuda.Ptr]uint64),
			vmm:      newVMMState(),
			ipc:      newIPCState(),
		})
	}
	d.register()
	return d
}

// device returns device dev; mu must be held.
// admitPhysical applies the rules every allocation of physical memory obeys
// (MemAlloc, MemCreate): the calling thread's capture mode, injected
// failures, then the capacity. d.mu is held.
func (d *Driver) admitPhysical(tid int, dv *device, call string, size uint64) error {
	if err := d.checkUnsafe(tid, call); err != nil {
		return err
	}
	if dv.failAllocs > 0 {
		dv.failAllocs--
		return cuda.ErrOutOfMemory
	}
	d.settle(dv)
	if size > dv.free() {
		return cuda.ErrOutOfMemory
	}
	return nil
}

func (d *Driver) device(dev int) (*device, error) {
	if dev < 0 || dev >= len(d.devs) {
		return nil, cuda.ErrInvalidDevice
	}
	return d.devs[dev], nil
}

// mustDevice is device for the test controls, where a bad index is a bug in
// the test; mu must be held.
func (d *Driver) mustDevice(dev int) *device {
	dv, err := d.device(dev)
	if err != nil {
		panic(fmt.Sprintf("sim: device %d: %v", dev, err))
	}
	return dv
}

// stream returns s's counters, creating them on first use; mu must be held.
func (d *Driver) stream(s cuda.Stream) *stream {
	st := d.streams[s]
	if st == nil {
		st = &stream{}
		d.streams[s] = st
	}
	return st
}

// destroyed reports whether s was destroyed; mu must be held. A call that
// names it is refused (refuseDestroyed).
func (d *Driver) destroyed(s cuda.Stream) bool {
	st := d.streams[s]
	return st != nil && st.destroyed
}

// refuseDestroyed records call, which named the destroyed stream s, as a
// violation and returns its error; mu must be held.
func (d *Driver) refuseDestroyed(call string, s cuda.Stream) error {
	d.violate(fmt.Sprintf("%s: stream %#x was destroyed (using its handle again is undefined behaviour in CUDA)", call, uintptr(s)), nil)
	return cuda.ErrInvalidHandle
}

// DestroyStream models the application destroying one of its own streams
// (PyTorch's, CuPy's, Numba's: not one StreamCreate made, which
// StreamDestroy destroys): work queued on it still completes, and every
// later call that names it is a violation (refuseDestroyed). Events
// recorded on it before stay valid, as in CUDA.
func (d *Driver) DestroyStream(s cuda.Stream) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stream(s).destroyed = true
}

// event returns a live event, checking that dev is the device it was created
// on (the interface promises callers name the event's device); mu must be
// held.
func (d *Driver) event(dev int, e cuda.Event) (*event, error) {
	if _, err := d.device(dev); err != nil {
		return nil, err
	}
	ev := d.events[e]
	if ev == nil || ev.dev != dev {
		return nil, cuda.ErrInvalidHandle
	}
	return ev, nil
}

// mode returns thread tid's capture mode; mu must be held.
func (d *Driver) mode(tid int) cuda.CaptureMode {
	if m, ok := d.modes[tid]; ok {
		return m
	}
	return cuda.CaptureModeGlobal
}

// prohibitors returns the captures that forbid thread tid a potentially unsafe
// call under its current mode, in id order; mu must be held.
func (d *Driver) prohibitors(tid int) []*capture {
	mode := d.mode(tid)
	var out []*capture
	for _, c := range d.captures {
		own := c.tid == tid && c.mode != cuda.CaptureModeRelaxed
		switch mode {
		case cuda.CaptureModeGlobal:
			if c.mode == cuda.CaptureModeGlobal || own {
				out = append(out, c)
			}
		case cuda.CaptureModeThreadLocal:
			if own {
				out = append(out, c)
			}
		}
	}
	sortCaptures(out)
	return out
}

func sortCaptures(cs []*capture) {
	sort.Slice(cs, func(i, j int) bool { return cs[i].id < cs[j].id })
}

// violate records a violation and invalidates the captures that caused it;
// mu must be held.
func (d *Driver) violate(msg string, culprits []*capture) {
	d.violations++
	if len(culprits) > 0 {
		names := make([]string, len(culprits))
		for i, c := range culprits {
			c.invalidated = true
			names[i] = c.String()
		}
		msg += ": invalidated " + strings.Join(names, ", ")
	}
	d.violationLog = append(d.violationLog, msg)
}

// checkUnsafe refuses a potentially unsafe call by thread tid if its mode and
// the captures in progress forbid it; mu must be held.
func (d *Driver) checkUnsafe(tid int, call string) error {
	culprits := d.prohibitors(tid)
	if len(culprits) == 0 {
		return nil
	}
	d.violate(fmt.Sprintf("%s on thread %d (mode %v) during capture", call, tid, d.mode(tid)), culprits)
	return cuda.ErrCaptureUnsupported
}

// checkCapturedEvent refuses to query or wait on an event last recorded in a
// capture: it stands for a graph node, not for work; mu must be held.
func (d *Driver) checkCapturedEvent(tid int, call string, ev *event) error {
	if ev.captureID == 0 {
		return nil
	}
	d.violate(fmt.Sprintf("%s on thread %d: event last recorded in capture %d", call, tid, ev.captureID), nil)
	return cuda.ErrCapturedEvent
}

// DeviceCount returns the number of simulated devices.
func (d *Driver) DeviceCount() (int, error) {
	return len(d.devs), nil
}

// MemGetInfo returns capacity less our use and external use, and capacity.
func (d *Driver) MemGetInfo(dev int) (free, total uint64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return 0, 0, err
	}
	d.settle(dv)
	return dv.free(), dv.capacity, nil
}

// MemAlloc allocates size bytes at a fresh 2 MiB-aligned address. It is a
// potentially unsafe call. It fails with ErrOutOfMemory when size exceeds
// what MemGetInfo reports free, or while failures injected by FailAllocs
// remain.
func (d *Driver) MemAlloc(dev int, size uint64) (cuda.Ptr, error) {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return 0, err
	}
	if size == 0 {
		return 0, cuda.ErrInvalidValue
	}
	if err := d.admitPhysical(tid, dv, fmt.Sprintf("MemAlloc(dev=%d, size=%d)", dev, size), size); err != nil {
		return 0, err
	}
	// Only a huge capacity from Options could exhaust the address range. The
	// first test bounds size, so rounding it up cannot overflow.
	room := dv.limit - dv.next
	if size > room || alignUp(size) > room {
		return 0, cuda.ErrOutOfMemory
	}
	p := cuda.Ptr(dv.next)
	dv.next += alignUp(size)
	dv.live[p] = size
	dv.used += size
	dv.allocs++
	return p, nil
}

// MemFree frees a live allocation of dev. It is refused during any capture,
// whatever the modes, and then invalidates every capture in progress.
// Freeing an allocation while an IPC mapping of it is open succeeds but is a
// violation (see ipc.go).
func (d *Driver) MemFree(dev int, p cuda.Ptr) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return err
	}
	if err := d.checkNoCapture(fmt.Sprintf("MemFree(dev=%d, ptr=%#x) on thread %d", dev, uintptr(p), tid)); err != nil {
		return err
	}
	size, ok := dv.live[p]
	if !ok {
		return cuda.ErrInvalidValue
	}
	d.ipcFreed(tid, dev, p)
	delete(dv.live, p)
	dv.freeContents(p)
	dv.used -= size
	dv.frees++
	return nil
}

// checkNoCapture refuses a call that is illegal during any capture whatever
// the modes (a free), invalidating every capture in progress; mu must be
// held.
func (d *Driver) checkNoCapture(call string) error {
	if len(d.captures) == 0 {
		return nil
	}
	all := make([]*capture, 0, len(d.captures))
	for _, c := range d.captures {
		all = append(all, c)
	}
	sortCaptures(all)
	d.violate(call+" during capture", all)
	return cuda.ErrCaptureUnsupported
}

// DeviceSynchronize completes all work on every stream (streams are not tied
// to devices). It is a potentially unsafe call.
func (d *Driver) DeviceSynchronize(dev int) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return err
	}
	if err := d.checkUnsafe(tid, fmt.Sprintf("DeviceSynchronize(dev=%d)", dev)); err != nil {
		return err
	}
	d.completeAll()
	return nil
}

// StreamCaptureInfo reports s's capture status and the capture's id. It is
// legal during capture.
func (d *Driver) StreamCaptureInfo(dev int, s cuda.Stream) (cuda.CaptureStatus, uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return cuda.CaptureNone, 0, err
	}
	if d.destroyed(s) {
		return cuda.CaptureNone, 0, d.refuseDestroyed(fmt.Sprintf("StreamCaptureInfo(dev=%d)", dev), s)
	}
	c := d.captureOf(s)
	switch {
	case c == nil:
		return cuda.CaptureNone, 0, nil
	case c.invalidated:
		return cuda.CaptureInvalidated, c.id, nil
	}
	return cuda.CaptureActive, c.id, nil
}

// ExchangeCaptureMode sets the calling OS thread's capture mode and returns
// the previous one. On an invalid mode it changes nothing and returns the
// current mode with ErrInvalidValue.
func (d *Driver) ExchangeCaptureMode(mode cuda.CaptureMode) (cuda.CaptureMode, error) {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	prev := d.mode(tid)
	if !validMode(mode) {
		return prev, cuda.ErrInvalidValue
	}
	if mode == cuda.CaptureModeGlobal {
		delete(d.modes, tid) // keep the map to threads off the default
	} else {
		d.modes[tid] = mode
	}
	return prev, nil
}

func alignUp(n uint64) uint64 {
	return (n + allocAlign - 1) / allocAlign * allocAlign
}

func validMode(m cuda.CaptureMode) bool {
	switch m {
	case cuda.CaptureModeGlobal, cuda.CaptureModeThreadLocal, cuda.CaptureModeRelaxed:
		return true
	}
	return false
}

// EventCreate returns a new event on dev. Handles are unique and non-zero.
// A never-recorded event is complete.
func (d *Driver) EventCreate(dev int) (cuda.Event, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.device(dev); err != nil {
		return 0, err
	}
	d.lastEvent++
	d.events[d.lastEvent] = &event{dev: dev}
	d.eventsCreated++
	return d.lastEvent, nil
}

// EventRecord snapshots the work submitted so far on s. On a capturing stream
// it is legal and makes e a captured event; on a stream whose capture was
// invalidated it fails with ErrCaptureInvalidated, as CUDA does. dev must be
// the device e was created on (ErrInvalidHandle otherwise).
func (d *Driver) EventRecord(dev int, e cuda.Event, s cuda.Stream) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, err := d.event(dev, e)
	if err != nil {
		return err
	}
	if d.destroyed(s) {
		return d.refuseDestroyed(fmt.Sprintf("EventRecord(dev=%d, event=%d)", dev, e), s)
	}
	if c := d.captureOf(s); c != nil {
		if c.invalidated {
			return cuda.ErrCaptureInvalidated
		}
		*ev = event{dev: dev, s: s, captureID: c.id, nodes: append([]cuda.GraphNode(nil), c.g.terminals[s]...)}
		return nil
	}
	*ev = event{dev: dev, s: s, target: d.stream(s).submitted}
	return nil
}

// EventQuery reports whether the work e captured has completed. It is a
// potentially unsafe call, and fails with ErrCapturedEvent on a captured
// event.
func (d *Driver) EventQuery(dev int, e cuda.Event) (bool, error) {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, err := d.event(dev, e)
	if err != nil {
		return false, err
	}
	if err := d.checkUnsafe(tid, fmt.Sprintf("EventQuery(dev=%d, event=%d)", dev, e)); err != nil {
		return false, err
	}
	if err := d.checkCapturedEvent(tid, fmt.Sprintf("EventQuery(dev=%d, event=%d)", dev, e), ev); err != nil {
		return false, err
	}
	return d.stream(ev.s).completed >= ev.target, nil
}

// EventSynchronize models waiting for e: it completes e's stream up to e. It
// is a potentially unsafe call, and fails with ErrCapturedEvent on a captured
// event.
func (d *Driver) EventSynchronize(dev int, e cuda.Event) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	ev, err := d.event(dev, e)
	if err != nil {
		return err
	}
	if err := d.checkUnsafe(tid, fmt.Sprintf("EventSynchronize(dev=%d, event=%d)", dev, e)); err != nil {
		return err
	}
	if err := d.checkCapturedEvent(tid, fmt.Sprintf("EventSynchronize(dev=%d, event=%d)", dev, e), ev); err != nil {
		return err
	}
	st := d.stream(ev.s)
	st.completed = max(st.completed, ev.target)
	d.applyCopies()
	return nil
}

// EventDestroy destroys e. It is legal during capture.
func (d *Driver) EventDestroy(dev int, e cuda.Event) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.event(dev, e); err != nil {
		return err
	}
	delete(d.events, e)
	d.eventsGone++
	return nil
}

// DeviceProcesses lists the processes using dev, as NVML would: the external
// process (ExternalPID) if SetExternalUse gave it memory, then this process
// with the bytes it has allocated.
func (d *Driver) DeviceProcesses(dev int) ([]cuda.ProcessMemory, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv, err := d.device(dev)
	if err != nil {
		return nil, err
	}
	d.settle(dv)
	var ps []cuda.ProcessMemory
	if dv.external > 0 {
		ps = append(ps, cuda.ProcessMemory{PID: ExternalPID, Bytes: dv.external})
	}
	return append(ps, cuda.ProcessMemory{PID: uint32(os.Getpid()), Bytes: dv.used}), nil
}

// BeginCapture starts capturing s in mode, on behalf of the calling OS thread.
// It fails with ErrInvalidValue on an invalid mode or a stream already
// capturing, and with ErrCaptureUnsupported on the legacy stream (0), which
// CUDA cannot capture.
func (d *Driver) BeginCapture(s cuda.Stream, mode cuda.CaptureMode) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case !validMode(mode):
		return cuda.ErrInvalidValue
	case s == 0:
		return cuda.ErrCaptureUnsupported
	case d.captureOf(s) != nil:
		return cuda.ErrInvalidValue
	}
	d.lastCapture++
	d.captures[s] = &capture{id: d.lastCapture, s: s, mode: mode, tid: tid, g: newGraph()}
	return nil
}

// EndCapture ends s's capture. It returns ErrCaptureInvalidated if the capture
// was invalidated (ending it all the same), ErrInvalidValue if s is not
// capturing, and, as CUDA does, ErrCaptureWrongThread when a non-relaxed
// capture is ended by a thread other than the one that began it; that capture
// stays in progress. Ending on a stream that joined the capture fails with
// ErrCaptureUnmatched (it stays in progress); ending with a joined stream's
// work not joined back into s ends the capture and fails with
// ErrCaptureUnjoined.
func (d *Driver) EndCapture(s cuda.Stream) error {
	tid := syscall.Gettid()
	d.mu.Lock()
	defer d.mu.Unlock()
	c := d.captures[s]
	if c == nil {
		if d.joined[s] != nil {
			return cuda.ErrCaptureUnmatched
		}
		return cuda.ErrInvalidValue
	}
	if c.mode != cuda.CaptureModeRelaxed && c.tid != tid {
		return cuda.ErrCaptureWrongThread
	}
	unjoined := d.unjoined(c)
	delete(d.captures, s)
	d.endJoined(c)
	switch {
	case c.invalidated:
		return cuda.ErrCaptureInvalidated
	case unjoined:
		return cuda.ErrCaptureUnjoined
	}
	return nil
}

// ActiveCaptures returns the number of captures begun and not yet ended,
// invalidated ones included.
func (d *Driver) ActiveCaptures() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.captures)
}

// Submit enqueues one unit of work on s. On a capturing stream the work goes
// into the capture's graph as a node instead (graph.go).
func (d *Driver) Submit(s cuda.Stream) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if c := d.captureOf(s); c != nil {
		if !c.invalidated {
			d.addNode(c.g, s)
		}
		return
	}
	d.stream(s).submitted++
}

// Complete completes all work submitted so far on s.
func (d *Driver) Complete(s cuda.Stream) {
	d.mu.Lock()
	defer d.mu.Unlock()
	st := d.stream(s)
	st.completed = st.submitted
	d.applyCopies()
}

// CompleteAll completes all work on every stream.
func (d *Driver) CompleteAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.completeAll()
}

// completeAll: mu must be held.
func (d *Driver) completeAll() {
	for _, st := range d.streams {
		st.completed = st.submitted
	}
	d.applyCopies()
}

// The test controls and counters below panic on a bad device index: that is
// a bug in the test, not a driver error.

// SetExternalUse sets the bytes another process holds on dev, which reduce
// free memory.
func (d *Driver) SetExternalUse(dev int, bytes uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.mustDevice(dev).external = bytes
}

// FailAllocs makes the next n MemAlloc or MemCreate calls on dev that pass
// their other checks fail with ErrOutOfMemory.
func (d *Driver) FailAllocs(dev int, n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.mustDevice(dev).failAllocs = n
}

// Allocs returns the number of successful MemAlloc calls on dev.
func (d *Driver) Allocs(dev int) int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mustDevice(dev).allocs
}

// Frees returns the number of successful MemFree calls on dev.
func (d *Driver) Frees(dev int) int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mustDevice(dev).frees
}

// Used returns the bytes allocated and not freed on dev, including physical
// memory this process created whose handles it has released while another
// process still holds it (share.go).
func (d *Driver) Used(dev int) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	dv := d.mustDevice(dev)
	d.settle(dv)
	return dv.used
}

// Live returns the number of live allocations on dev.
func (d *Driver) Live(dev int) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.mustDevice(dev).live)
}

// Capacity returns dev's capacity in bytes.
func (d *Driver) Capacity(dev int) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mustDevice(dev).capacity
}

// LiveEvents returns events created minus events destroyed.
func (d *Driver) LiveEvents() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return int(d.eventsCreated - d.eventsGone)
}

// Violations returns the number of violations since New or the last
// ResetViolations: calls that broke a capture rule, and frees of memory
// still open through CUDA IPC.
func (d *Driver) Violations() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.violations
}

// ViolationLog returns a copy of the violations' descriptions, oldest first.
func (d *Driver) ViolationLog() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.violationLog...)
}

// ResetViolations clears the violation counter and log. Captures already
// invalidated stay invalidated.
func (d *Driver) ResetViolations() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.violations = 0
	d.violationLog = nil
}
