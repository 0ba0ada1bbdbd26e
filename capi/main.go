// SPDX-License-Identifier: Apache-2.0

// Command capi is libcudapool.so, cudapool's C ABI (include/cudapool.h),
// built with go build -buildmode=c-shared.
//
// # Design
//
// Why the exports are wrapped in C. The Go functions exported here are
// named cpgo_* and are not the library's interface: cudapool.c defines the
// public cudapool_* functions, each of which first checks whether it runs in
// a child made by fork() and only then calls its cpgo_* twin. The check
// must happen before entering Go: a Go runtime does not survive fork (its
// other threads are gone; the child hangs at its first allocation), and
// PyTorch's DataLoader forks workers from processes that use CUDA. A
// pthread_atfork child handler, registered by a constructor in cudapool.c,
// sets the flag; in a child every function returns at once and records an
// error. exports.map (a linker version script) keeps only cudapool_* in the
// dynamic symbol table, so the cpgo_* functions cannot be called around the
// check.
//
// torchabi.go holds the exports behind the C ABI that cudapool's C++
// allocator class for PyTorch uses (python/cudapool/csrc): statistics as a
// struct, pools, checkpoints, memory history with caller-kept contexts,
// snapshots as C structs, CUDA IPC. The class is built against the user's
// torch, outside this library, and calls only cudapool_* functions.
//
// torch.cpp holds the entry points PyTorch calls with C++ types
// (std::pair pool ids, std::function stream filters) and the throwing
// malloc; C++ exceptions are thrown there, after the Go call has returned,
// and never cross Go frames.
//
// Errors. The last error is C thread-local storage (cudapool.c), written
// from Go through cp_set_error: a cgo callback runs on the calling C thread,
// so it lands in the caller's slot. It is set by every failure and left
// alone by every success (errno-like), so a successful malloc never touches
// it. A message starts with the name of the public function the caller
// called ("cudapool_free: ..."): each export knows its own, and the exports
// behind several public functions are told by their C wrapper (CP_FN_*).
// Every export recovers panics: a panic is a cudapool bug, possibly with
// a device lock still held, so it disables the library for the rest of the
// process (every later call fails with the panic's message) instead of
// crashing the host or risking a deadlock.
//
// State. One *allocator.Allocator, created on the first call from the
// environment (see include/cudapool.h): CUDAPOOL_BACKEND picks the real
// driver (cuda/driver) or the simulator (cuda/sim); CUDAPOOL_CONF, else
// PYTORCH_CUDA_ALLOC_CONF, is the configuration. A failed initialization
// is final: every call fails with its message, also printed once on stderr.
// A bad configuration is not: the call that initializes the library fails
// with it (as PyTorch throws at its first allocation), it is printed once
// on stderr, and the allocator runs with the default configuration, so that
// one mistake does not fail every later call.
//
// This package only converts C types and wires the other packages together.
package main

/*
// cp_take_frees copies into the caller's buffer and never calls Go: the
// buffer may stay on the Go stack (no allocation per drain).
#cgo noescape cp_take_frees
#cgo nocallback cp_take_frees
#include "capi.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/capi/warm"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/driver"
	"github.com/cudapool/cudapool/cuda/sim"
)

func main() {}

// state is what every call works on. A state with err set makes every call
// fail with err.
type state struct {
	a       *allocator.Allocator
	sim     *sim.Driver // nil unless the backend is the simulator
	backend string
	err     error
	// confErr is why the environment's configuration was refused (the
	// allocator then has the default one): the initializing call's error.
	confErr error
}

var (
	current  atomic.Pointer[state]
	initOnce sync.Once
	// keeper keeps the runtime warm while calls come (capi/warm): every
	// export that gets a working state touches it (ready, and the malloc
	// and free exports after their own check: load stays inlinable). Set
	// by the configuration's warm_runtime (newState, configure).
	keeper warm.Keeper
)

// load returns the state, initializing it on the first call. Inlined into
// the exports: the first call's work is out of line.
func load() *state {
	if st := current.Load(); st != nil {
		return st
	}
	return loadFirst()
}

// loadFirst initializes the state. The call that does it gets a state of
// its own that fails with a refused configuration (state.confErr), once;
// every other call gets the allocator.
//
//go:noinline
func loadFirst() *state {
	var first *state
	initOnce.Do(func() {
		var st *state
		func() {
			defer func() {
				if r := recover(); r != nil {
					st = &state{err: fmt.Errorf("cudapool: initialization failed: internal error: %v", r)}
				}
			}()
			st = newState(lookupEnv)
		}()
		if st.confErr != nil {
			warnOnce(st.confErr.Error())
		}
		if st.err != nil {
			warnOnce(st.err.Error())
		} else if st.confErr != nil {
			first = &state{err: st.confErr, backend: st.backend}
		}
		current.CompareAndSwap(nil, st)
	})
	if first != nil {
		return first
	}
	return current.Load()
}

// ready returns the allocator, or records the initialization error as a
// failure of fn and returns nil.
// Every entry point but the mallocs first performs the frees PyTorch queued
// (cudapool_torch_free), so that nothing observes a queued free.
func ready(fn string) *allocator.Allocator {
	st := load()
	if st.err != nil {
		fail(fn, st.err)
		return nil
	}
	keeper.Touch()
	if C.cp_freeq_n != 0 {
		var buf [C.CP_FREEQ_CAP]allocator.PendingFree
		reportFreeError(fn, st.a.Free(takeFrees(&buf)...))
	}
	return st.a
}

// failState records the state's error (initialization failed, or the
// library is disabled) as a failure of fn and returns 0: the mallocs' way
// out, kept out of their code.
//
//go:noinline
func failState(fn string, st *state) C.uintptr_t {
	fail(fn, st.err)
	return 0
}

// takeFrees moves the queued frees into buf and returns them.
func takeFrees(buf *[C.CP_FREEQ_CAP]allocator.PendingFree) []allocator.PendingFree {
	n := int(C.cp_take_frees((*C.cp_pending_free)(unsafe.Pointer(&buf[0])), C.CP_FREEQ_CAP))
	return buf[:n]
}

// pendingFrees returns the n frees at p as they are: cp_pending_free is laid
// out as allocator.PendingFree (checked below), so nothing is copied.
func pendingFrees(p *C.cp_pending_free, n C.size_t) []allocator.PendingFree {
	return unsafe.Slice((*allocator.PendingFree)(unsafe.Pointer(p)), int(n))
}

// The layouts of cp_pending_free and allocator.PendingFree agree: each
// constant below overflows, and the package does not compile, if not.
var (
	layoutC  C.cp_pending_free
	layoutGo allocator.PendingFree
)

const (
	_ = 0 - (unsafe.Sizeof(layoutC) ^ unsafe.Sizeof(layoutGo))
	_ = 0 - (unsafe.Offsetof(layoutC.device) ^ unsafe.Offsetof(layoutGo.Dev))
	_ = 0 - (unsafe.Sizeof(layoutC.device) ^ unsafe.Sizeof(layoutGo.Dev))
	_ = 0 - (unsafe.Offsetof(layoutC.ptr) ^ unsafe.Offsetof(layoutGo.Ptr))
	_ = 0 - (unsafe.Offsetof(layoutC.size) ^ unsafe.Offsetof(layoutGo.Size))
	_ = 0 - (unsafe.Offsetof(layoutC.ctx) ^ unsafe.Offsetof(layoutGo.Ctx))
	_ = 0 - (unsafe.Offsetof(layoutC.op) ^ unsafe.Offsetof(layoutGo.Op))
	_ = 0 - (unsafe.Sizeof(layoutC.op) ^ unsafe.Sizeof(layoutGo.Op))
	_ = 0 - (unsafe.Offsetof(layoutC.count) ^ unsafe.Offsetof(layoutGo.Count))
	_ = 0 - (uint8(C.CP_OP_FREE) ^ uint8(allocator.OpFree))
	_ = 0 - (uint8(C.CP_OP_FREE_STATS) ^ uint8(allocator.OpFreeStats))
	_ = 0 - (uint8(C.CP_OP_REUSE) ^ uint8(allocator.OpReuse))
	_ = 0 - (uint8(C.CP_OP_CYCLES) ^ uint8(allocator.OpCycles))
	_ = 0 - (uint8(C.CP_OP_RELEASE) ^ uint8(allocator.OpRelease))
	_ = 0 - (uint8(C.CP_OP_HOLD) ^ uint8(allocator.OpHold))
	// The front's tags for the default pools and for a block it may hold.
	_ = 0 - (uint32(1) ^ allocator.TagDefault)
	_ = 0 - (uint32(C.CP_TAG_HOLD) ^ allocator.TagHold)
)

// reportFreeError reports a failed queued free, performed during fn (or by
// fn itself, when its queue was full): PyTorch ignores the result of its
// free hook, so besides this thread's last error it goes to stderr. The
// message names the functions that queued frees (cp_freeq_from), usually
// one: the queue does not keep who queued each free.
func reportFreeError(fn string, err error) {
	if err == nil {
		return
	}
	var by []string
	for id, name := range entryNames {
		if C.cp_freeq_from&(1<<id) != 0 && name != "" {
			by = append(by, name)
		}
	}
	msg := errorText(fn, err) + " (a free queued by " + strings.Join(by, " or ") + ")"
	setError(msg)
	warnOnce(msg)
}

// entryNames names the public functions that share an export, by their
// CP_FN_* number (capi.h).
var entryNames = [...]string{
	C.CP_FN_MALLOC:                     "cudapool_malloc",
	C.CP_FN_MALLOC_CTX:                 "cudapool_malloc_ctx",
	C.CP_FN_CUPY_MALLOC:                "cudapool_cupy_malloc",
	C.CP_FN_TORCH_MALLOC:               "cudapool_torch_malloc",
	C.CP_FN_FREE_DEFERRED:              "cudapool_free_deferred",
	C.CP_FN_TORCH_FREE:                 "cudapool_torch_free",
	C.CP_FN_CUPY_FREE:                  "cudapool_cupy_free",
	C.CP_FN_END_ALLOCATE_TO_POOL:       "cudapool_end_allocate_to_pool",
	C.CP_FN_TORCH_END_ALLOCATE_TO_POOL: "cudapool_torch_end_allocate_to_pool",
	C.CP_FN_RELEASE_POOL:               "cudapool_release_pool",
	C.CP_FN_TORCH_RELEASE_POOL:         "cudapool_torch_release_pool",
	C.CP_FN_EXPECT_ANNOUNCED_CAPTURES:  "cudapool_expect_announced_captures",
	C.CP_FN_CUPY_MALLOC_RAISING:        "cudapool_cupy_malloc_raising",
}

// fnMalloc is cudapool_malloc's number (for the tests, which cannot use
// cgo).
const fnMalloc = C.CP_FN_MALLOC

// entryName returns the name of the public function numbered fn.
func entryName(fn C.int) string {
	if fn > 0 && int(fn) < len(entryNames) {
		return entryNames[fn]
	}
	return "cudapool"
}

// newState builds the allocator that the environment describes.
func newState(lookup func(string) (string, bool)) *state {
	backend, _ := lookup("CUDAPOOL_BACKEND")
	backend = strings.ToLower(strings.TrimSpace(backend))
	st := &state{backend: backend}
	confVar := "CUDAPOOL_CONF"
	conf, ok := lookup(confVar)
	if !ok {
		confVar = "PYTORCH_CUDA_ALLOC_CONF"
		conf, _ = lookup(confVar)
	}
	cfg, warnings, err := allocator.ParseConfig(conf)
	reportWarnings(warnings)
	if err != nil {
		// The message quotes the offending item (cut if long), not the
		// whole variable.
		st.confErr = fmt.Errorf("%s: %s; cudapool runs with the default configuration", confVar, message(err))
		cfg = allocator.DefaultConfig()
	}
	var drv allocator.Driver
	switch backend {
	case "sim":
		opts, err := simOptions(lookup)
		if err != nil {
			st.err = err
			return st
		}
		kinds, err := simShareable(lookup)
		if err != nil {
			st.err = err
			return st
		}
		st.sim = sim.New(opts)
		st.sim.SetShareableKinds(kinds)
		drv = st.sim
	case "", "cuda":
		st.backend = "cuda"
		d, err := driver.Open()
		if err != nil {
			st.err = fmt.Errorf("cudapool: the CUDA driver cannot be used (%s); install the NVIDIA driver, or set CUDAPOOL_BACKEND=sim to run on the simulator",
				strings.TrimPrefix(err.Error(), "cudapool: "))
			return st
		}
		drv = d
	default:
		st.err = fmt.Errorf("cudapool: CUDAPOOL_BACKEND=%q: expected cuda (the default) or sim", backend)
		return st
	}
	a, err := allocator.New(drv, cfg)
	if err != nil {
		st.err = err
		return st
	}
	a.SetWarningHandler(warnOnce)
	a.SetFront(cFront{})
	keeper.SetEnabled(cfg.WarmRuntime)
	st.a = a
	return st
}

// simOptions reads CUDAPOOL_SIM_DEVICES and CUDAPOOL_SIM_MEMORY.
func simOptions(lookup func(string) (string, bool)) (sim.Options, error) {
	opts := sim.Options{Devices: 1, Memory: 80 << 30}
	if v, ok := lookup("CUDAPOOL_SIM_DEVICES"); ok && strings.TrimSpace(v) != "" {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || n < 1 || n > 1024 {
			return opts, fmt.Errorf("cudapool: CUDAPOOL_SIM_DEVICES=%q: expected a number of devices from 1 to 1024", v)
		}
		opts.Devices = n
	}
	if v, ok := lookup("CUDAPOOL_SIM_MEMORY"); ok && strings.TrimSpace(v) != "" {
		n, err := parseBytes(v)
		if err != nil {
			return opts, fmt.Errorf("cudapool: CUDAPOOL_SIM_MEMORY=%q: %v", v, err)
		}
		opts.Memory = n
	}
	return opts, nil
}

// simShareable reads CUDAPOOL_SIM_SHAREABLE, the handle kinds through
// which the simulated devices can export physical memory: fd (the
// default: one node without an IMEX channel, where PyTorch and cudapool
// share expandable memory as file descriptors), fabric, "fd,fabric", or
// none.
func simShareable(lookup func(string) (string, bool)) (cuda.ShareableKind, error) {
	v, ok := lookup("CUDAPOOL_SIM_SHAREABLE")
	if !ok || strings.TrimSpace(v) == "" {
		return cuda.ShareablePOSIXFD, nil
	}
	var k cuda.ShareableKind
	for _, w := range strings.Split(v, ",") {
		switch strings.TrimSpace(w) {
		case "fd":
			k |= cuda.ShareablePOSIXFD
		case "fabric":
			k |= cuda.ShareableFabric
		case "none":
		default:
			return 0, fmt.Errorf("cudapool: CUDAPOOL_SIM_SHAREABLE=%q: expected fd, fabric, fd,fabric or none", v)
		}
	}
	return k, nil
}

// parseBytes reads a byte count with an optional binary suffix: 80G,
// 512MiB, 4096.
func parseBytes(s string) (uint64, error) {
	s = strings.TrimSpace(s)
	digits := len(s) - len(strings.TrimLeft(s, "0123456789"))
	unit := strings.ToUpper(strings.TrimSpace(s[digits:]))
	unit = strings.TrimSuffix(strings.TrimSuffix(unit, "B"), "I")
	shift, ok := map[string]uint{"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[unit]
	n, err := strconv.ParseUint(s[:digits], 10, 64)
	if !ok || err != nil || n == 0 {
		return 0, errors.New("expected a positive number of bytes, optionally with a suffix K, M, G or T (powers of 1024)")
	}
	if n > (1<<60)>>shift {
		return 0, errors.New("more than 1 EiB")
	}
	return n << shift, nil
}

// poison disables the library after an internal error.
func poison(err error) {
	frontOff() // the front serves nothing for a disabled library
	old := current.Load()
	st := &state{err: err}
	if old != nil {
		st.backend = old.backend
	}
	current.Store(st)
}

// guard is deferred by every export with the name of its public function:
// it turns a panic into an error and disables the library (see the package
// comment).
func guard(fn string) {
	if r := recover(); r != nil {
		panicked(fn, r)
	}
}

// panicked handles the panic r that guard recovered in fn.
func panicked(fn string, r any) {
	err := fmt.Errorf("%s: internal error (%v); cudapool is disabled for the rest of this process", fn, r)
	poison(err)
	setError(err.Error())
	warnOnce(err.Error() + "\n" + string(debug.Stack()))
}

var warned sync.Map // messages already printed

// warnOnce prints msg on stderr once per process, prefixed "cudapool: "
// unless it starts with a function's name (cudapool_...).
func warnOnce(msg string) {
	if _, dup := warned.LoadOrStore(msg, true); dup {
		return
	}
	if !strings.HasPrefix(msg, "cudapool_") {
		msg = "cudapool: " + strings.TrimPrefix(msg, "cudapool: ")
	}
	fmt.Fprintln(os.Stderr, msg)
}

func reportWarnings(ws []string) {
	for _, w := range ws {
		warnOnce(w)
	}
}

// message is err's text without the name of the operation that failed:
// the allocator's errors name its own operations ("cudapool: malloc: "),
// and an entry point names itself instead.
func message(err error) string {
	var e *allocator.Error
	if errors.As(err, &e) {
		if e.Err != nil {
			return e.Msg + ": " + e.Err.Error()
		}
		return e.Msg
	}
	return strings.TrimPrefix(err.Error(), "cudapool: ")
}

// errorText is the message of err as a failure of the public function fn.
func errorText(fn string, err error) string { return fn + ": " + message(err) }

// fail records err as the calling thread's last error, a failure of fn.
func fail(fn string, err error) { setError(errorText(fn, err)) }

// failf records a formatted message as the calling thread's last error, a
// failure of fn.
func failf(fn, format string, args ...any) { setError(fn + ": " + fmt.Sprintf(format, args...)) }
