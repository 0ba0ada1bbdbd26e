// Package cuda holds the vocabulary shared by every layer of cudapool:
// opaque CUDA handles, capture states and driver result codes.
//
// It contains no calls into CUDA. The real driver lives in cuda/driver and a
// simulated one in cuda/sim; the layers above talk to either through small
// interfaces that they declare themselves.
package cuda

import "fmt"

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
