// SPDX-License-Identifier: Apache-2.0

// Package cuda holds the vocabulary shared by every layer of cudapool:
// opaque CUDA handles, capture states and driver result codes.
//
// It contains no calls into CUDA. The real driver lives in cuda/driver and a
// simulated one in cuda/sim; the layers above talk to either through small
// interfaces that they declare themselves.
package cuda

import (
	"fmt"
	"syscall"
)

// Stream is a driver stream handle (CUstream, the same value as a
// cudaStream_t). Zero is the legacy default stream.
type Stream uintptr

// Event is a driver event handle (CUevent).
type Event uintptr

// Ptr is a device address (CUdeviceptr).
type Ptr uintptr

// MemHandle is a physical memory allocation made by cuMemCreate
// (CUmemGenericAllocationHandle). Zero is never a valid handle.
type MemHandle uint64

// GraphNode is a node of a CUDA graph (CUgraphNode). During a capture the
// driver names the capture's current terminal nodes of a stream with these,
// and a node's dependencies are nodes too.
type GraphNode uintptr

// IpcHandle is a CUDA IPC memory handle (CUipcMemHandle, the same 64 bytes
// as a cudaIpcMemHandle_t): it names an allocation made with cuMemAlloc so
// that another process can map it (cuIpcOpenMemHandle). Its bytes are opaque
// and may be sent to another process as they are.
type IpcHandle [64]byte

// CaptureStatus mirrors CUstreamCaptureStatus.
type CaptureStatus int

const (
	CaptureNone        CaptureStatus = 0
	CaptureActive      CaptureStatus = 1
	CaptureInvalidated CaptureStatus = 2
)

// CaptureMode mirrors CUstreamCaptureMode: which API calls a thread may make
// while a capture is under way.
type CaptureMode int

const (
	CaptureModeGlobal      CaptureMode = 0
	CaptureModeThreadLocal CaptureMode = 1
	CaptureModeRelaxed     CaptureMode = 2
)

func (m CaptureMode) String() string {
	switch m {
	case CaptureModeGlobal:
		return "global"
	case CaptureModeThreadLocal:
		return "thread-local"
	case CaptureModeRelaxed:
		return "relaxed"
	}
	return fmt.Sprintf("CaptureMode(%d)", int(m))
}

// Result is a CUresult. A non-zero Result is an error; both the real driver
// and the simulator return these so that callers can test with errors.Is.
type Result int

// The driver results the allocator distinguishes (values from cuda.h).
const (
	ErrInvalidValue       Result = 1
	ErrOutOfMemory        Result = 2
	ErrNotInitialized     Result = 3
	ErrDeinitialized      Result = 4
	ErrNoDevice           Result = 100
	ErrInvalidDevice      Result = 101
	ErrInvalidContext     Result = 201
	ErrInvalidHandle      Result = 400
	ErrNotFound           Result = 500
	ErrNotReady           Result = 600
	ErrNotPermitted       Result = 800
	ErrNotSupported       Result = 801
	ErrCaptureUnsupported Result = 900
	ErrCaptureInvalidated Result = 901
	ErrCaptureMerge       Result = 902
	ErrCaptureUnmatched   Result = 903
	ErrCaptureUnjoined    Result = 904
	ErrCaptureIsolation   Result = 905
	ErrCaptureImplicit    Result = 906
	ErrCapturedEvent      Result = 907
	ErrCaptureWrongThread Result = 908
	ErrUnknown            Result = 999
)

var resultNames = map[Result]string{
	ErrInvalidValue:       "CUDA_ERROR_INVALID_VALUE",
	ErrOutOfMemory:        "CUDA_ERROR_OUT_OF_MEMORY",
	ErrNotInitialized:     "CUDA_ERROR_NOT_INITIALIZED",
	ErrDeinitialized:      "CUDA_ERROR_DEINITIALIZED",
	ErrNoDevice:           "CUDA_ERROR_NO_DEVICE",
	ErrInvalidDevice:      "CUDA_ERROR_INVALID_DEVICE",
	ErrInvalidContext:     "CUDA_ERROR_INVALID_CONTEXT",
	ErrInvalidHandle:      "CUDA_ERROR_INVALID_HANDLE",
	ErrNotFound:           "CUDA_ERROR_NOT_FOUND",
	ErrNotReady:           "CUDA_ERROR_NOT_READY",
	ErrNotPermitted:       "CUDA_ERROR_NOT_PERMITTED",
	ErrNotSupported:       "CUDA_ERROR_NOT_SUPPORTED",
	ErrCaptureUnsupported: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
	ErrCaptureInvalidated: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
	ErrCaptureMerge:       "CUDA_ERROR_STREAM_CAPTURE_MERGE",
	ErrCaptureUnmatched:   "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
	ErrCaptureUnjoined:    "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
	ErrCaptureIsolation:   "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
	ErrCaptureImplicit:    "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
	ErrCapturedEvent:      "CUDA_ERROR_CAPTURED_EVENT",
	ErrCaptureWrongThread: "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
	ErrUnknown:            "CUDA_ERROR_UNKNOWN",
}

func (r Result) Error() string {
	if n, ok := resultNames[r]; ok {
		return fmt.Sprintf("%s (%d)", n, int(r))
	}
	return fmt.Sprintf("CUresult %d", int(r))
}

// Check converts a raw CUresult into an error (nil for CUDA_SUCCESS).
func Check(code int) error {
	if code == 0 {
		return nil
	}
	return Result(code)
}

// ProcessMemory is one process's use of a device, as NVML reports it.
type ProcessMemory struct {
	PID   uint32
	Bytes uint64
}

// ShareableKind is a set of CUmemAllocationHandleType bits: the kinds of
// OS handle through which another process may import a physical allocation
// (cuMemCreate with requestedHandleTypes, cuMemExportToShareableHandle,
// cuMemImportFromShareableHandle). Zero asks for none.
type ShareableKind uint32

const (
	// ShareablePOSIXFD is CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: a file
	// descriptor of the exporting process, which an importer duplicates
	// with pidfd_getfd.
	ShareablePOSIXFD ShareableKind = 0x1
	// ShareableFabric is CU_MEM_HANDLE_TYPE_FABRIC: 64 opaque bytes
	// (CUmemFabricHandle) that any process on the fabric may import; it
	// needs driver and system support (an IMEX channel).
	ShareableFabric ShareableKind = 0x8
)

func (k ShareableKind) String() string {
	switch k {
	case 0:
		return "none"
	case ShareablePOSIXFD:
		return "posix-fd"
	case ShareableFabric:
		return "fabric"
	case ShareablePOSIXFD | ShareableFabric:
		return "posix-fd|fabric"
	}
	return fmt.Sprintf("ShareableKind(%#x)", uint32(k))
}

// FabricHandle is a CUmemFabricHandle: 64 opaque bytes that name a physical
// allocation to every process of the fabric.
type FabricHandle [64]byte

// ShareableHandle is what cuMemExportToShareableHandle gives for one
// physical allocation: a file descriptor of the exporting process
// (ShareablePOSIXFD) or a fabric handle (ShareableFabric), according to
// Kind.
type ShareableHandle struct {
	Kind   ShareableKind
	FD     int // Kind == ShareablePOSIXFD
	Fabric FabricHandle
}

// PidfdError is a failed pidfd_open(2) or pidfd_getfd(2): the calls through
// which an importer duplicates the exporter's file descriptors. Its message
// says what is missing; errors.Is(err, syscall.ENOSYS) and the like work
// through Unwrap.
type PidfdError struct {
	Call  string // "pidfd_open" or "pidfd_getfd"
	PID   int    // the exporting process
	FD    int    // pidfd_getfd: the descriptor in PID's table
	Errno syscall.Errno
}

func (e *PidfdError) Error() string {
	switch e.Errno {
	case syscall.ENOSYS:
		if e.Call == "pidfd_open" {
			return "pidfd_open: the kernel lacks pidfd_open (Linux 5.3+), which importing CUDA memory shared as file descriptors needs"
		}
		return "pidfd_getfd: the kernel lacks pidfd_getfd (Linux 5.6+), which importing CUDA memory shared as file descriptors needs"
	case syscall.EPERM:
		// pidfd_getfd checks PTRACE_MODE_ATTACH_REALCREDS; under Yama's
		// ptrace_scope 1 only an ancestor (or a process the target named
		// with PR_SET_PTRACER) may attach, hence the spelled-out rule.
		return fmt.Sprintf("%s: ptrace permission to process %d is needed to take its file descriptors "+
			"(same user, and kernel.yama.ptrace_scope 0, or 1 with process %d a descendant of this one or naming it with PR_SET_PTRACER; or CAP_SYS_PTRACE)",
			e.Call, e.PID, e.PID)
	case syscall.ESRCH:
		return fmt.Sprintf("%s: process %d has exited", e.Call, e.PID)
	case syscall.EMFILE:
		return fmt.Sprintf("%s(process %d): %v: this process has as many descriptors open as its limit of open files allows (RLIMIT_NOFILE; raise it with ulimit -n)", e.Call, e.PID, e.Errno)
	case syscall.EBADF:
		if e.Call == "pidfd_getfd" {
			return fmt.Sprintf("pidfd_getfd: file descriptor %d is not open in process %d (the exporter closed it, or the handle is stale), or the pidfd is not valid", e.FD, e.PID)
		}
	}
	return fmt.Sprintf("%s(process %d): %v", e.Call, e.PID, e.Errno)
}

func (e *PidfdError) Unwrap() error { return e.Errno }
