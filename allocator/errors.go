// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/cudapool/cudapool/pools"
)

// The kinds of failure. Every error the allocator returns wraps exactly one
// of these, so callers test with errors.Is; the message says what and why.
var (
	ErrInvalidDevice    = errors.New("invalid device")
	ErrInvalidArgument  = errors.New("invalid argument")
	ErrUnknownPointer   = errors.New("unknown pointer")
	ErrAlreadyFreed     = errors.New("pointer already freed")
	ErrWrongDevice      = errors.New("pointer belongs to another device")
	ErrOutOfMemory      = errors.New("out of memory")
	ErrUnknownPool      = errors.New("unknown memory pool")
	ErrAlreadyRecording = errors.New("pool already recording")
	ErrNotRecording     = errors.New("pool not recording")
	ErrCaptureUnderway  = errors.New("capture under way")
	ErrInvalidConfig    = errors.New("invalid configuration")
	ErrDriver           = errors.New("CUDA driver error")
	// ErrPaused: a malloc from a paused tag (tags.go), or a capture begun
	// into a paused tag's pool.
	ErrPaused = errors.New("tag paused")
	// ErrInUse: a pause of memory another process may be using (exported
	// through CUDA IPC).
	ErrInUse = errors.New("memory in use by another process")
)

// Error is a failure of one allocator operation.
type Error struct {
	Op   string // "malloc", "free", ...
	Kind error  // one of the Err* values above
	Msg  string
	Err  error // the underlying driver error, if any
	// OOM describes an out-of-memory failure of malloc (nil otherwise).
	OOM *OOMInfo
}

// OOMInfo is what PyTorch tells its out-of-memory observers.
type OOMInfo struct {
	Device int
	Size   uint64 // the segment size that could not be allocated
	Total  uint64 // the device's memory, or the memory fraction's limit
	Free   uint64 // the device's free memory
}

// OOMInfoOf returns the out-of-memory details of a malloc error, or nil.
func OOMInfoOf(err error) *OOMInfo {
	var e *Error
	if errors.As(err, &e) {
		return e.OOM
	}
	return nil
}

func (e *Error) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("cudapool: %s: %s: %v", e.Op, e.Msg, e.Err)
	}
	return fmt.Sprintf("cudapool: %s: %s", e.Op, e.Msg)
}

// Is matches the error's kind.
func (e *Error) Is(target error) bool { return target == e.Kind }

// Unwrap returns the driver error, if any.
func (e *Error) Unwrap() error { return e.Err }

func newError(op string, kind error, format string, args ...any) *Error {
	return &Error{Op: op, Kind: kind, Msg: fmt.Sprintf(format, args...)}
}

func driverError(op string, err error, format string, args ...any) *Error {
	return &Error{Op: op, Kind: ErrDriver, Msg: fmt.Sprintf(format, args...), Err: err}
}

// OOMText renders an out-of-memory failure of a malloc of size bytes in
// cudapool's words, for programs that call cudapool directly (its C entry
// points): what was asked, what the device has free, what cudapool holds,
// and what to try, in cudapool's terms (CUDAPOOL_CONF keys). Error keeps
// PyTorch's message, which PyTorch's entry points pass on unchanged. ok is
// false for any other error. It reads the device's statistics (taking its
// lock): for the failure path only.
func (a *Allocator) OOMText(err error, size uint64) (text string, ok bool) {
	var e *Error
	if !errors.As(err, &e) || e.Kind != ErrOutOfMemory {
		return "", false
	}
	info := e.OOM
	if info == nil { // caching off, or an absurd size: the message says it all
		return e.Msg, true
	}
	var b strings.Builder
	fmt.Fprintf(&b, "out of memory on device %d: cannot allocate %s (%d bytes", info.Device, FormatSize(size), size)
	if info.Size != size {
		fmt.Fprintf(&b, ", in a segment of %d", info.Size)
	}
	b.WriteString(")")
	if info.Total == 0 {
		b.WriteString("; the device's free memory is unknown (the driver did not say)")
	} else if f, ferr := a.MemoryFraction(info.Device); ferr == nil && f < 1 {
		fmt.Fprintf(&b, "; the device has %s free, and per_process_memory_fraction %g allows cudapool %s", FormatSize(info.Free), f, FormatSize(info.Total))
	} else {
		fmt.Fprintf(&b, "; the device has %s free of %s", FormatSize(info.Free), FormatSize(info.Total))
	}
	if pl, ok := a.drv.(processLister); ok {
		if procs, perr := pl.DeviceProcesses(info.Device); perr == nil && len(procs) > 0 {
			b.WriteString("; in use on it:")
			for i, p := range procs {
				sep := ","
				if i == 0 {
					sep = ""
				}
				if int(p.PID) == os.Getpid() {
					fmt.Fprintf(&b, "%s this process %s (cudapool's and any other)", sep, FormatSize(p.Bytes))
				} else {
					fmt.Fprintf(&b, "%s process %d %s", sep, p.PID, FormatSize(p.Bytes))
				}
			}
		}
	}
	if st, serr := a.Stats(info.Device); serr == nil {
		allocated := uint64(st.AllocatedBytes[pools.StatAll].Current)
		reserved := uint64(st.ReservedBytes[pools.StatAll].Current)
		fmt.Fprintf(&b, ". cudapool holds %s on it: %s allocated, %s reserved but unallocated", FormatSize(reserved), FormatSize(allocated), FormatSize(reserved-min(allocated, reserved)))
	}
	b.WriteString(" (before failing, cudapool gave its cached whole segments back to the driver, as cudapool_empty_cache() does, unless a graph capture was under way).")
	// What to try depends on what is on: the hint names the next step.
	switch cfg := a.Config(); {
	case !cfg.ExpandableSegments:
		b.WriteString(" If reserved but unallocated memory is large, cudapool's default configuration (expandable segments with" +
			" stitching: leave out expandable_segments:False from CUDAPOOL_CONF) or max_split_size_mb:N (to keep large cached" +
			" blocks whole) may avoid the fragmentation.")
	case !cfg.Stitch:
		b.WriteString(" If reserved but unallocated memory is large, stitching (cudapool's default: leave out stitch:False" +
			" from CUDAPOOL_CONF) may avoid the fragmentation.")
	default:
		b.WriteString(" With expandable segments and stitching (the default), memory still reserved but unallocated after that" +
			" is in partly used pages or in private pools (CUDA graphs, MemPools), which give it back once released.")
	}
	return b.String(), true
}
