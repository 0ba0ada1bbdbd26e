// SPDX-License-Identifier: Apache-2.0

package vmem

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/cudapool/cudapool/cuda"
)

// PyTorch's handle for sharing a CUDA tensor's memory with another process,
// in both of its forms, so that cudapool and native PyTorch exchange
// tensors in either direction.
//
// The handle is the byte string of c10::cuda::CUDACachingAllocator's
// ShareableHandle.handle, which DeviceCachingAllocator::shareIpcHandle
// writes and NativeCachingAllocator::getIpcDevPtr reads (its
// MemHandleCacheEntry); the block's offset travels beside it
// (ShareableHandle.offset). Integers are in the machine's byte order, which
// is little-endian on every platform PyTorch ships CUDA for (x86-64,
// AArch64), and so are written little-endian here. The layout, as PyTorch
// 2.5 to 2.12 write it (SHAREABLE_HANDLE_VERSION 2 since fabric handles
// arrived, about 2.8; 1 before):
//
//	byte 0     the version
//	byte 1     the type: 'c' (SHAREABLE_CUDA_MALLOC) or 'e'
//	           (SHAREABLE_CUDA_EXPANDABLE_SEGMENT)
//	'c'        the 64-byte cudaIpcMemHandle_t of the cudaMalloc'd segment
//	           that holds the block; the offset is the block's in it
//	'e'        what ExpandableSegment::share writes: its ShareHeader, 24
//	           bytes (pid_t pid at 0, 4 bytes of padding, size_t
//	           segment_size at 8, size_t num_handles at 16), then one entry
//	           per physical allocation (each segment_size bytes) under the
//	           block, from the one holding its first byte to the one holding
//	           its last: an int file descriptor of process pid (4 bytes),
//	           or a 64-byte CUmemFabricHandle. The offset is the block's from
//	           the start of the first of them.
//
// A handle of exactly 64 bytes is a bare cudaIpcMemHandle_t from a PyTorch
// older than the versioned form.
//
// Which kind of entry follows the header is not written down: PyTorch 2.11's
// ExpandableSegment::fromShared reads entries of the kind its own process
// chose for its own expandable segments (a process-wide setting, decided by
// its first expandable allocation: fabric if cuMemCreate accepts a fabric
// handle kind, else file descriptors; a process that has allocated nothing
// reads file descriptors). The lengths tell them apart unambiguously (4 or
// 64 bytes an entry, at least one entry), which is how ParseStorageHandle
// reads them, whatever this process chose. PyTorch 2.13 (version 3) puts the
// kind in the header and changes its layout; it is refused with a clear
// error, as PyTorch refuses versions newer than its own.
//
// The four padding bytes after the pid were left uninitialised by PyTorch
// before 2.9 (so two handles of one segment could differ in them) and again
// by 2.13 (github.com/pytorch/pytorch/issues/198305). A handle is therefore
// identified by its decoded fields, never by its bytes: SegmentShare.Key.
// Encoding writes them as zeros.
//
// Import policy (the import cache, ImportCache in shareimport.go): an import
// reserves exactly the bytes the handle covers, num_handles * segment_size,
// which is already a multiple of the granularity, and maps every entry into
// it. PyTorch's own import reserves address space for 9/8 of the device's
// memory per import whatever the handle covers (90 GiB on an 80 GiB H100),
// which exhausts the address space after about 1,450 distinct imports; the
// bound here is the shared bytes themselves, so 10,000 imports of 20 MiB
// tensors reserve 200 GiB. One mapping serves every open of the same
// segment range (same process, pid, segment size, kind and entries) and is
// reference counted; the last close synchronises the device, then unmaps,
// releases and frees it.

// The handle's version and type bytes.
const (
	// HandleVersion is the version this package writes, the newest it
	// reads (PyTorch's SHAREABLE_HANDLE_VERSION from 2.8 to 2.12).
	HandleVersion = 2
	// TypeCudaMalloc marks a handle of a cudaMalloc'd segment.
	TypeCudaMalloc = 'c'
	// TypeExpandable marks a handle of memory in an expandable segment.
	TypeExpandable = 'e'
)

// Sizes in the handle.
const (
	ipcHandleSize    = 64 // CUDA_IPC_HANDLE_SIZE
	shareHeaderSize  = 24 // sizeof(ShareHeader)
	fdEntrySize      = 4  // sizeof(int)
	fabricEntrySize  = 64 // sizeof(CUmemFabricHandle)
	storagePrefixLen = 2  // version and type bytes
)

// maxEntries bounds the entries a handle may list, so that a corrupt count
// cannot make a decoder allocate without limit: 2^20 entries of the
// smallest segment (2 MiB) cover 2 TiB, beyond any device.
const maxEntries = 1 << 20

// ErrBadHandle is the kind of error for bytes that are not a handle this
// package can read.
var ErrBadHandle = errors.New("not a readable CUDA IPC handle")

// StorageHandle is PyTorch's shareable handle decoded: the memory of a
// cudaMalloc'd segment (Type TypeCudaMalloc, IPC) or of an expandable
// segment (TypeExpandable, Segment).
type StorageHandle struct {
	Version byte // 0 for a bare cudaIpcMemHandle_t
	Type    byte
	IPC     cuda.IpcHandle
	Segment SegmentShare
}

// SegmentShare is the part of an expandable segment a handle shares: the
// physical allocations under a block, in address order, each SegmentSize
// bytes, exported by process PID as file descriptors (Kind
// cuda.ShareablePOSIXFD, FDs) or fabric handles (cuda.ShareableFabric,
// Fabric).
type SegmentShare struct {
	PID         int32
	SegmentSize uint64
	Kind        cuda.ShareableKind
	FDs         []int32
	Fabric      []cuda.FabricHandle
}

// Len returns the number of physical allocations s lists.
func (s *SegmentShare) Len() int {
	if s.Kind == cuda.ShareableFabric {
		return len(s.Fabric)
	}
	return len(s.FDs)
}

// Bytes returns the bytes s covers, which an importer maps.
func (s *SegmentShare) Bytes() uint64 { return uint64(s.Len()) * s.SegmentSize }

// Key returns s's identity: equal for two handles of the same allocations
// from the same process, whatever their padding or version bytes said.
func (s *SegmentShare) Key() string {
	b := make([]byte, 0, 16+s.Len()*fabricEntrySize)
	b = binary.LittleEndian.AppendUint32(b, uint32(s.PID))
	b = binary.LittleEndian.AppendUint32(b, uint32(s.Kind))
	b = binary.LittleEndian.AppendUint64(b, s.SegmentSize)
	for _, fd := range s.FDs {
		b = binary.LittleEndian.AppendUint32(b, uint32(fd))
	}
	for i := range s.Fabric {
		b = append(b, s.Fabric[i][:]...)
	}
	return string(b)
}

// validate checks what every encoder and importer relies on.
func (s *SegmentShare) validate() error {
	switch {
	case s.Kind != cuda.ShareablePOSIXFD && s.Kind != cuda.ShareableFabric:
		return fmt.Errorf("%w: expandable segment handle of kind %v", ErrBadHandle, s.Kind)
	case s.Kind == cuda.ShareablePOSIXFD && len(s.Fabric) != 0, s.Kind == cuda.ShareableFabric && len(s.FDs) != 0:
		return fmt.Errorf("%w: expandable segment handle of kind %v lists entries of the other kind", ErrBadHandle, s.Kind)
	case s.Len() == 0 || s.Len() > maxEntries:
		return fmt.Errorf("%w: expandable segment handle lists %d physical allocations (1 to %d)", ErrBadHandle, s.Len(), maxEntries)
	case s.SegmentSize == 0 || s.SegmentSize > math.MaxUint64/uint64(s.Len()):
		return fmt.Errorf("%w: expandable segment handle of %d allocations of %d bytes", ErrBadHandle, s.Len(), s.SegmentSize)
	case s.PID <= 0 && s.Kind == cuda.ShareablePOSIXFD:
		return fmt.Errorf("%w: expandable segment handle names process %d", ErrBadHandle, s.PID)
	}
	for _, fd := range s.FDs {
		if fd < 0 {
			return fmt.Errorf("%w: expandable segment handle lists file descriptor %d", ErrBadHandle, fd)
		}
	}
	return nil
}

// EncodeCudaMalloc returns the handle of a block of a cudaMalloc'd segment
// whose cudaIpcMemHandle_t is h, as DeviceCachingAllocator::shareIpcHandle
// writes it.
func EncodeCudaMalloc(h cuda.IpcHandle) []byte {
	b := make([]byte, 0, storagePrefixLen+ipcHandleSize)
	b = append(b, HandleVersion, TypeCudaMalloc)
	return append(b, h[:]...)
}

// EncodeSegment returns the handle of the physical allocations s lists, as
// DeviceCachingAllocator::shareIpcHandle and ExpandableSegment::share write
// it (with zero padding).
func EncodeSegment(s SegmentShare) ([]byte, error) {
	if err := s.validate(); err != nil {
		return nil, err
	}
	entry := fdEntrySize
	if s.Kind == cuda.ShareableFabric {
		entry = fabricEntrySize
	}
	b := make([]byte, 0, storagePrefixLen+shareHeaderSize+s.Len()*entry)
	b = append(b, HandleVersion, TypeExpandable)
	b = binary.LittleEndian.AppendUint32(b, uint32(s.PID))
	b = append(b, 0, 0, 0, 0)
	b = binary.LittleEndian.AppendUint64(b, s.SegmentSize)
	b = binary.LittleEndian.AppendUint64(b, uint64(s.Len()))
	for _, fd := range s.FDs {
		b = binary.LittleEndian.AppendUint32(b, uint32(fd))
	}
	for i := range s.Fabric {
		b = append(b, s.Fabric[i][:]...)
	}
	return b, nil
}

// ParseStorageHandle decodes a handle PyTorch (or EncodeCudaMalloc,
// EncodeSegment) wrote. Bytes that are no handle, or a handle of a newer
// PyTorch whose layout this package does not know, are an error of kind
// ErrBadHandle that says which.
func ParseStorageHandle(b []byte) (StorageHandle, error) {
	var h StorageHandle
	if len(b) == ipcHandleSize { // unversioned: a bare cudaIpcMemHandle_t
		h.Type = TypeCudaMalloc
		copy(h.IPC[:], b)
		return h, nil
	}
	if len(b) < storagePrefixLen {
		return h, fmt.Errorf("%w: %d bytes", ErrBadHandle, len(b))
	}
	h.Version, h.Type = b[0], b[1]
	if h.Version == 0 || h.Version > HandleVersion {
		return h, fmt.Errorf("%w: version %d (this cudapool reads versions 1 to %d, as PyTorch 2.5 to 2.12 write; "+
			"a newer PyTorch changed the layout of expandable segments' handles)", ErrBadHandle, h.Version, HandleVersion)
	}
	rest := b[storagePrefixLen:]
	switch h.Type {
	case TypeCudaMalloc:
		if len(rest) != ipcHandleSize {
			return h, fmt.Errorf("%w: a cudaMalloc handle of %d bytes (want %d)", ErrBadHandle, len(rest), ipcHandleSize)
		}
		copy(h.IPC[:], rest)
		return h, nil
	case TypeExpandable:
		s, err := parseSegment(rest)
		h.Segment = s
		return h, err
	}
	return h, fmt.Errorf("%w: type %q (want 'c' or 'e')", ErrBadHandle, h.Type)
}

// parseSegment decodes what ExpandableSegment::share wrote.
func parseSegment(b []byte) (SegmentShare, error) {
	var s SegmentShare
	if len(b) < shareHeaderSize {
		return s, fmt.Errorf("%w: an expandable segment handle of %d bytes, shorter than its header", ErrBadHandle, len(b))
	}
	s.PID = int32(binary.LittleEndian.Uint32(b[0:]))
	// b[4:8] is padding: ignored, since PyTorch does not always clear it.
	s.SegmentSize = binary.LittleEndian.Uint64(b[8:])
	n := binary.LittleEndian.Uint64(b[16:])
	entries := b[shareHeaderSize:]
	switch {
	case n == 0 || n > maxEntries:
		return s, fmt.Errorf("%w: an expandable segment handle listing %d physical allocations", ErrBadHandle, n)
	case uint64(len(entries)) == n*fdEntrySize:
		s.Kind = cuda.ShareablePOSIXFD
		s.FDs = make([]int32, n)
		for i := range s.FDs {
			s.FDs[i] = int32(binary.LittleEndian.Uint32(entries[i*fdEntrySize:]))
		}
	case uint64(len(entries)) == n*fabricEntrySize:
		s.Kind = cuda.ShareableFabric
		s.Fabric = make([]cuda.FabricHandle, n)
		for i := range s.Fabric {
			copy(s.Fabric[i][:], entries[i*fabricEntrySize:])
		}
	default:
		return s, fmt.Errorf("%w: an expandable segment handle listing %d physical allocations in %d bytes (want %d for file descriptors or %d for fabric handles)",
			ErrBadHandle, n, len(entries), n*fdEntrySize, n*fabricEntrySize)
	}
	return s, s.validate()
}
