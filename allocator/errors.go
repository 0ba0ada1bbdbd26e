package allocator

import (
	"errors"
	"fmt"
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
