// SPDX-License-Identifier: Apache-2.0

// Package fault wraps the simulated driver (cuda/sim) to make chosen driver
// calls fail, for the allocator's fault-injection tests.
//
// # Design
//
// Driver implements every driver interface the allocator consumes
// (allocator.Driver with events.Driver, and the optional VMM, IPC,
// capture-graph and process-listing interfaces) by forwarding to a *sim.Driver; it does not
// embed it, so a driver method added to the simulator is not silently
// promoted without an injection point (the allocator's fault tests check
// that this type declares every method of those interfaces). Relaxed adds
// MemAllocRelaxed, the optional one-call relaxed allocation of the real
// driver, so that both of the allocator's allocation paths can be reached.
//
// A Rule fails calls of one method, optionally only those made from a given
// call site: Site is matched against the names of the functions on the
// calling goroutine's stack (for example "(*device).newSegment"), so a rule
// can aim at one of several places that call the same method. A failed call
// does nothing and returns the rule's error; the simulator never sees it.
// The stack is only walked for methods that have a rule, so a driver with no
// rules costs one mutex per call.
package fault

import (
	"math/rand"
	"runtime"
	"strings"
	"sync"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

// Rule makes calls fail. Its fields are set by Fail and guarded by the
// owning Driver's mu.
type Rule struct {
	Method string // the driver method, e.g. "MemAlloc"
	Site   string // a substring of a caller's function name; "" any caller
	Skip   int    // matching calls to let through first
	Times  int    // matching calls to fail after those (then the rule is spent)
	Err    error  // what the failed calls return
	// Hook, if set, runs instead of failing (outside any lock of the
	// Driver), before the call is forwarded: a test's way to act while
	// the allocator is inside a given driver call.
	Hook func()
	hits int
}

// Driver is the simulator with injectable failures.
type Driver struct {
	Sim *sim.Driver // the wrapped simulator, for its test controls

	mu    sync.Mutex
	rules []*Rule        // guarded by mu
	calls map[string]int // calls per method, failed ones included; guarded by mu
	// Random failures (FailRandomly), all guarded by mu.
	randP       float64
	randErr     error
	randMethods map[string]bool
	rnd         *rand.Rand
	randHits    int
}

// New wraps s.
func New(s *sim.Driver) *Driver { return &Driver{Sim: s, calls: map[string]int{}} }

// Relaxed is Driver with MemAllocRelaxed.
type Relaxed struct{ *Driver }

// NewRelaxed wraps s, with MemAllocRelaxed.
func NewRelaxed(s *sim.Driver) *Relaxed { return &Relaxed{New(s)} }

// Fail adds a rule: the next call of method from site (after skip
// matching calls) fails with err. It returns the rule, whose Hits say
// whether it fired.
func (d *Driver) Fail(method, site string, skip int, err error) *Rule {
	r := &Rule{Method: method, Site: site, Skip: skip, Times: 1, Err: err}
	d.mu.Lock()
	d.rules = append(d.rules, r)
	d.mu.Unlock()
	return r
}

// Before adds a rule that runs fn before the next call of method from
// site, which then proceeds.
func (d *Driver) Before(method, site string, fn func()) *Rule {
	r := &Rule{Method: method, Site: site, Times: 1, Hook: fn}
	d.mu.Lock()
	d.rules = append(d.rules, r)
	d.mu.Unlock()
	return r
}

// Hits returns how many calls r failed (or ran its hook before).
func (d *Driver) Hits(r *Rule) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return r.hits
}

// FailRandomly makes every call of the given methods fail with err with
// probability p (a seeded sequence), until Clear.
func (d *Driver) FailRandomly(p float64, seed int64, err error, methods ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.randP, d.randErr, d.rnd = p, err, rand.New(rand.NewSource(seed))
	d.randMethods = map[string]bool{}
	for _, m := range methods {
		d.randMethods[m] = true
	}
}

// RandomHits returns the number of calls FailRandomly failed.
func (d *Driver) RandomHits() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.randHits
}

// Clear removes every rule and stops random failures.
func (d *Driver) Clear() {
	d.mu.Lock()
	d.rules = nil
	d.randMethods = nil
	d.mu.Unlock()
}

// Calls returns the number of calls of method so far.
func (d *Driver) Calls(method string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.calls[method]
}

// inject counts a call of method and returns the error it must fail with,
// or nil, after running the hook of a rule that has one.
func (d *Driver) inject(method string) error {
	hook, err := d.match(method)
	if hook != nil {
		hook()
	}
	return err
}

func (d *Driver) match(method string) (func(), error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.calls[method]++
	var stack string
	for _, r := range d.rules {
		if r.Method != method || r.hits >= r.Times {
			continue
		}
		if r.Site != "" {
			if stack == "" {
				stack = callers()
			}
			if !strings.Contains(stack, r.Site) {
				continue
			}
		}
		if r.Skip > 0 {
			r.Skip--
			continue
		}
		r.hits++
		if r.Hook != nil {
			return r.Hook, nil
		}
		return nil, r.Err
	}
	if d.randMethods[method] && d.rnd.Float64() < d.randP {
		d.randHits++
		return nil, d.randErr
	}
	return nil, nil
}

// callers returns the function names on the caller's stack, one a line.
func callers() string {
	pcs := make([]uintptr, 64)
	n := runtime.Callers(4, pcs)
	frames := runtime.CallersFrames(pcs[:n])
	var b strings.Builder
	for {
		f, more := frames.Next()
		b.WriteString(f.Function)
		b.WriteByte('\n')
		if !more {
			return b.String()
		}
	}
}

// allocator.Driver

func (d *Driver) DeviceCount() (int, error) {
	if err := d.inject("DeviceCount"); err != nil {
		return 0, err
	}
	return d.Sim.DeviceCount()
}

func (d *Driver) MemGetInfo(dev int) (uint64, uint64, error) {
	if err := d.inject("MemGetInfo"); err != nil {
		return 0, 0, err
	}
	return d.Sim.MemGetInfo(dev)
}

func (d *Driver) MemAlloc(dev int, size uint64) (cuda.Ptr, error) {
	if err := d.inject("MemAlloc"); err != nil {
		return 0, err
	}
	return d.Sim.MemAlloc(dev, size)
}

func (d *Driver) MemFree(dev int, p cuda.Ptr) error {
	if err := d.inject("MemFree"); err != nil {
		return err
	}
	return d.Sim.MemFree(dev, p)
}

func (d *Driver) DeviceSynchronize(dev int) error {
	if err := d.inject("DeviceSynchronize"); err != nil {
		return err
	}
	return d.Sim.DeviceSynchronize(dev)
}

func (d *Driver) StreamCaptureInfo(dev int, s cuda.Stream) (cuda.CaptureStatus, uint64, error) {
	if err := d.inject("StreamCaptureInfo"); err != nil {
		return cuda.CaptureNone, 0, err
	}
	return d.Sim.StreamCaptureInfo(dev, s)
}

func (d *Driver) ExchangeCaptureMode(mode cuda.CaptureMode) (cuda.CaptureMode, error) {
	if err := d.inject("ExchangeCaptureMode"); err != nil {
		return mode, err
	}
	return d.Sim.ExchangeCaptureMode(mode)
}

// events.Driver

func (d *Driver) EventCreate(dev int) (cuda.Event, error) {
	if err := d.inject("EventCreate"); err != nil {
		return 0, err
	}
	return d.Sim.EventCreate(dev)
}

func (d *Driver) EventRecord(dev int, e cuda.Event, s cuda.Stream) error {
	if err := d.inject("EventRecord"); err != nil {
		return err
	}
	return d.Sim.EventRecord(dev, e, s)
}

func (d *Driver) EventQuery(dev int, e cuda.Event) (bool, error) {
	if err := d.inject("EventQuery"); err != nil {
		return false, err
	}
	return d.Sim.EventQuery(dev, e)
}

func (d *Driver) EventSynchronize(dev int, e cuda.Event) error {
	if err := d.inject("EventSynchronize"); err != nil {
		return err
	}
	return d.Sim.EventSynchronize(dev, e)
}

func (d *Driver) EventDestroy(dev int, e cuda.Event) error {
	if err := d.inject("EventDestroy"); err != nil {
		return err
	}
	return d.Sim.EventDestroy(dev, e)
}

// The process list (the OOM message)

func (d *Driver) DeviceProcesses(dev int) ([]cuda.ProcessMemory, error) {
	if err := d.inject("DeviceProcesses"); err != nil {
		return nil, err
	}
	return d.Sim.DeviceProcesses(dev)
}

// Virtual memory management (expandable segments)

func (d *Driver) MemGranularity(dev int) (uint64, error) {
	if err := d.inject("MemGranularity"); err != nil {
		return 0, err
	}
	return d.Sim.MemGranularity(dev)
}

func (d *Driver) MemAddressReserve(dev int, size uint64) (cuda.Ptr, error) {
	if err := d.inject("MemAddressReserve"); err != nil {
		return 0, err
	}
	return d.Sim.MemAddressReserve(dev, size)
}

func (d *Driver) MemAddressFree(dev int, p cuda.Ptr, size uint64) error {
	if err := d.inject("MemAddressFree"); err != nil {
		return err
	}
	return d.Sim.MemAddressFree(dev, p, size)
}

func (d *Driver) MemCreate(dev int, size uint64) (cuda.MemHandle, error) {
	if err := d.inject("MemCreate"); err != nil {
		return 0, err
	}
	return d.Sim.MemCreate(dev, size)
}

func (d *Driver) MemRelease(dev int, h cuda.MemHandle) error {
	if err := d.inject("MemRelease"); err != nil {
		return err
	}
	return d.Sim.MemRelease(dev, h)
}

func (d *Driver) MemMap(dev int, p cuda.Ptr, size uint64, h cuda.MemHandle) error {
	if err := d.inject("MemMap"); err != nil {
		return err
	}
	return d.Sim.MemMap(dev, p, size, h)
}

func (d *Driver) MemSetAccess(dev int, p cuda.Ptr, size uint64) error {
	if err := d.inject("MemSetAccess"); err != nil {
		return err
	}
	return d.Sim.MemSetAccess(dev, p, size)
}

func (d *Driver) MemUnmap(dev int, p cuda.Ptr, size uint64) error {
	if err := d.inject("MemUnmap"); err != nil {
		return err
	}
	return d.Sim.MemUnmap(dev, p, size)
}

// Capture graph topology (graph_capture_record_stream_reuse)

func (d *Driver) StreamCaptureGraph(dev int, s cuda.Stream, buf []cuda.GraphNode) (cuda.CaptureStatus, uint64, []cuda.GraphNode, error) {
	if err := d.inject("StreamCaptureGraph"); err != nil {
		return cuda.CaptureNone, 0, buf, err
	}
	return d.Sim.StreamCaptureGraph(dev, s, buf)
}

func (d *Driver) GraphNodeDependencies(dev int, n cuda.GraphNode, buf []cuda.GraphNode) ([]cuda.GraphNode, error) {
	if err := d.inject("GraphNodeDependencies"); err != nil {
		return buf, err
	}
	return d.Sim.GraphNodeDependencies(dev, n, buf)
}

// CUDA IPC

func (d *Driver) IpcGetMemHandle(dev int, p cuda.Ptr) (cuda.IpcHandle, error) {
	if err := d.inject("IpcGetMemHandle"); err != nil {
		return cuda.IpcHandle{}, err
	}
	return d.Sim.IpcGetMemHandle(dev, p)
}

func (d *Driver) IpcOpenMemHandle(dev int, h cuda.IpcHandle) (cuda.Ptr, error) {
	if err := d.inject("IpcOpenMemHandle"); err != nil {
		return 0, err
	}
	return d.Sim.IpcOpenMemHandle(dev, h)
}

func (d *Driver) IpcCloseMemHandle(dev int, p cuda.Ptr) error {
	if err := d.inject("IpcCloseMemHandle"); err != nil {
		return err
	}
	return d.Sim.IpcCloseMemHandle(dev, p)
}

// Sharing physical memory with other processes (CUDA IPC of expandable
// segments). PID and FDLimit cannot fail: they forward.

func (d *Driver) MemCreateShareable(dev int, size uint64, kinds cuda.ShareableKind) (cuda.MemHandle, error) {
	if err := d.inject("MemCreateShareable"); err != nil {
		return 0, err
	}
	return d.Sim.MemCreateShareable(dev, size, kinds)
}

func (d *Driver) MemExportShareable(dev int, h cuda.MemHandle, kind cuda.ShareableKind) (cuda.ShareableHandle, error) {
	if err := d.inject("MemExportShareable"); err != nil {
		return cuda.ShareableHandle{}, err
	}
	return d.Sim.MemExportShareable(dev, h, kind)
}

func (d *Driver) MemImportShareable(dev int, sh cuda.ShareableHandle) (cuda.MemHandle, error) {
	if err := d.inject("MemImportShareable"); err != nil {
		return 0, err
	}
	return d.Sim.MemImportShareable(dev, sh)
}

func (d *Driver) ShareableKinds(dev int) (cuda.ShareableKind, error) {
	if err := d.inject("ShareableKinds"); err != nil {
		return 0, err
	}
	return d.Sim.ShareableKinds(dev)
}

func (d *Driver) ProbeFabric(dev int) error {
	if err := d.inject("ProbeFabric"); err != nil {
		return err
	}
	return d.Sim.ProbeFabric(dev)
}

func (d *Driver) PidfdOpen(pid int) (int, error) {
	if err := d.inject("PidfdOpen"); err != nil {
		return -1, err
	}
	return d.Sim.PidfdOpen(pid)
}

func (d *Driver) PidfdGetfd(pidfd, pid, fd int) (int, error) {
	if err := d.inject("PidfdGetfd"); err != nil {
		return -1, err
	}
	return d.Sim.PidfdGetfd(pidfd, pid, fd)
}

// CloseFD closes fd, or, when a rule fails it, leaves it open (as a close
// that failed would).
func (d *Driver) CloseFD(fd int) error {
	if err := d.inject("CloseFD"); err != nil {
		return err
	}
	return d.Sim.CloseFD(fd)
}

func (d *Driver) PID() int        { return d.Sim.PID() }
func (d *Driver) FDLimit() uint64 { return d.Sim.FDLimit() }

// MemAllocRelaxed allocates with the calling thread in relaxed capture
// mode, as the real driver's one-call version does. It locks the goroutine
// to its thread for the three calls, which the simulator's per-thread modes
// need.
func (r *Relaxed) MemAllocRelaxed(dev int, size uint64) (cuda.Ptr, error) {
	if err := r.inject("MemAllocRelaxed"); err != nil {
		return 0, err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	prev, err := r.Sim.ExchangeCaptureMode(cuda.CaptureModeRelaxed)
	if err != nil {
		return 0, err
	}
	p, err := r.Sim.MemAlloc(dev, size)
	_, _ = r.Sim.ExchangeCaptureMode(prev)
	return p, err
}
