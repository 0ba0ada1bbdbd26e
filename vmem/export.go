// SPDX-License-Identifier: Apache-2.0

package vmem

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// Exporting physical memory to other processes: CUDA IPC of expandable and
// stitched memory, in PyTorch's handle format (share.go).
//
// # Design
//
// Creation. From its first growth on, every physical allocation a Space
// creates (Map) is shareable, with one handle kind chosen once per device
// (chooseKind): a fabric handle where the device supports it and
// ProbeFabric's create, export and import pass, else a POSIX file
// descriptor. That is PyTorch 2.11's choice: its first expandable growth
// tries a fabric cuMemCreate and keeps file descriptors if that fails, and
// its importer reads entries of the kind its own process chose (a process
// that never grew an expandable segment reads descriptors), so two
// processes on one node without an IMEX channel both use descriptors. A
// first growth during a capture chooses descriptors without probing: the
// probe releases memory, which a capture forbids.
//
// Export (Share). A block's handle lists the physical allocations under
// it, from the one holding its first byte to the one holding its last,
// and the block's offset from the first one's start. Each allocation is
// exported at most once, when a handle first needs it, and its descriptor
// or fabric handle is kept with it (exports): every handle of one range is
// then the same bytes (native PyTorch's importer caches mappings by the
// bytes) and a second export costs nothing. A descriptor is closed only
// when its allocation is released (release), never earlier: a handle in
// flight names descriptor numbers, and a number closed and then reused by
// another export would make the importer map other memory (cuda/sim's
// TestShareDescriptorNumberReuse).
//
// Exported pages and stitching. The memory under an allocated block never
// moves and is never released: stitching takes only whole pages inside
// free blocks (pools.Donors), release (empty_cache, the OOM retry,
// TrimUnused) only whole chunks inside free blocks, and a pause by tag
// (pause.go) only a tag none of whose allocated blocks was exported (the
// allocator refuses the others: pools.Block.Shared). A shared block stays
// allocated until its importers are done (the caller's protocol; PyTorch's
// reference-counter file keeps the sender's storage alive), so an exported
// page keeps its handle and its descriptor as long as a handle naming them
// may be in flight. Once the block is freed its pages are free like any
// other: a move (unmap, map the same handle elsewhere, or lend) keeps the
// handle and so its descriptor, and a later export of a block over the
// page's new place names the same descriptor; a release closes it. An
// importer's mapping holds its own reference to the memory, which the
// driver frees when the last process lets go.
//
// One size. PyTorch's handle has one segment size for all its entries, so
// the allocations under a block must be of one size: they are in ranges
// mapped page by page (the small pools, and the default large pool when
// stitching is on) and in the default pools' chunked ranges, whose growth
// maps whole chunks (pools.growSize). A chunked range can still hold
// shorter allocations, at a tail mapped short when the memory fraction or
// the device had no room for a whole chunk, or pages stitching moved into
// it. Private pools' and tags' large ranges map each growth as allocations
// of its own size (space.go, chunkSize): a block within one growth shares.
// A block over allocations of two sizes cannot be shared (ErrNotShareable
// says which and why).
//
// Descriptors. Each allocation exported as a file descriptor holds one
// descriptor of this process until its release: the process's limit of
// open files (RLIMIT_NOFILE) bounds how much memory can be exported at
// once. Only what a handle needs is exported, and an export the system
// refuses says how many descriptors exports hold and what the limit is.
//
// Capture rules. Exporting is legal during a capture (no stream is
// involved; cuda/sim models it so). Descriptors are closed only where
// handles are released, never during a capture.

// ShareDriver is what a Space needs to create physical memory that other
// processes can import, and to export it: cuda/driver.Driver and
// cuda/sim.Driver have it.
type ShareDriver interface {
	// ShareableKinds returns the handle kinds dev's memory can be
	// exported through.
	ShareableKinds(dev int) (cuda.ShareableKind, error)
	// ProbeFabric reports whether fabric handles work on dev (nil).
	ProbeFabric(dev int) error
	// MemCreateShareable is MemCreate for memory exportable through kinds.
	MemCreateShareable(dev int, size uint64, kinds cuda.ShareableKind) (cuda.MemHandle, error)
	// MemExportShareable exports h as a new descriptor (which the caller
	// closes) or as its fabric handle.
	MemExportShareable(dev int, h cuda.MemHandle, kind cuda.ShareableKind) (cuda.ShareableHandle, error)
	// CloseFD closes a descriptor of this process.
	CloseFD(fd int) error
	// PID is this process's id, which handles carry.
	PID() int
	// FDLimit is the process's limit of open descriptors, 0 if unknown.
	FDLimit() uint64
}

// ErrNotShareable is the kind of error for memory that cannot be exported
// to another process.
var ErrNotShareable = errors.New("memory cannot be shared with another process")

// shareState is a Space's side of exporting.
type shareState struct {
	drv ShareDriver // nil: the driver cannot share physical memory
	// kind is the handle kind physical allocations are created with, once
	// chosen (chooseKind); 0: not shareable, for the reason why.
	kind   cuda.ShareableKind
	chosen bool
	why    string
	// exports holds each exported physical allocation's descriptor or
	// fabric handle, until its release; fds counts the descriptors.
	exports map[cuda.MemHandle]cuda.ShareableHandle
	fds     int
	scratch []cuda.MemHandle // Share's
}

// chooseKind chooses, at the first growth, the handle kind of every
// physical allocation (see the file comment). capturing: a capture may be
// under way, so no probe.
func (s *Space) chooseKind(capturing bool) {
	sh := &s.share
	sh.chosen = true
	if sh.drv == nil {
		sh.why = "the CUDA driver in use cannot share physical memory"
		return
	}
	kinds, err := sh.drv.ShareableKinds(s.dev)
	if err != nil {
		sh.why = fmt.Sprintf("reading which handle kinds device %d can export failed (%v)", s.dev, err)
		return
	}
	if kinds&cuda.ShareableFabric != 0 && !capturing && sh.drv.ProbeFabric(s.dev) == nil {
		sh.kind = cuda.ShareableFabric
		return
	}
	if kinds&cuda.ShareablePOSIXFD != 0 {
		sh.kind = cuda.ShareablePOSIXFD
		return
	}
	sh.why = fmt.Sprintf("device %d exports physical memory neither as file descriptors nor as fabric handles", s.dev)
}

// ShareKind returns the handle kind of this device's physical allocations
// (0 before the first growth, or when they are not shareable).
func (s *Space) ShareKind() cuda.ShareableKind { return s.share.kind }

// Share exports the physical allocations under the allocated block b of an
// expandable segment and returns what PyTorch's handle carries: the
// allocations, in address order, and b's offset from the first one's
// start. Errors are of kind ErrNotShareable, or from the driver (through
// the owner's Fail, operation op). The owner's lock is held.
func (s *Space) Share(b *pools.Block, op string) (SegmentShare, uint64, error) {
	sh := &s.share
	if sh.kind == 0 {
		why := sh.why
		if why == "" {
			why = "no physical memory was created on it yet"
		}
		return SegmentShare{}, 0, fmt.Errorf("%w: pointer %#x on device %d is in an expandable segment whose physical memory was not created shareable: %s",
			ErrNotShareable, uintptr(b.Ptr), s.dev, why)
	}
	seg := b.Seg
	page := seg.PageSize
	off := uint64(b.Ptr - seg.Base)
	end := off + b.Size
	lo := off / page * page
	for !seg.ChunkBoundary(lo) {
		lo -= page
	}
	hs := sh.scratch[:0]
	var size uint64
	for o := lo; o < end; {
		h := seg.Page(o / page)
		n := seg.ChunkAt(o)
		switch {
		case h == 0:
			return SegmentShare{}, 0, fmt.Errorf("%w: pointer %#x on device %d: nothing is mapped at offset %d of its range", ErrNotShareable, uintptr(b.Ptr), s.dev, o)
		case size == 0:
			size = n
		case n != size:
			why := fmt.Sprintf("a range mapped short when the device or the memory fraction had no room for a whole %d-byte chunk, or given pages by stitching, can hold such blocks", seg.ChunkSize)
			if !seg.WholeChunks && seg.ChunkSize > page {
				why = "its range, a private pool's or a tag's, maps each growth as allocations of the growth's own size, and the block spans two growths"
			}
			return SegmentShare{}, 0, fmt.Errorf("%w: the %d-byte block at %#x on device %d lies on physical allocations of %d and %d bytes, "+
				"and PyTorch's handle describes allocations of one size (%s)", ErrNotShareable, b.Size, uintptr(b.Ptr), s.dev, size, n, why)
		}
		hs = append(hs, h)
		o += n
	}
	sh.scratch = hs[:0]
	out := SegmentShare{PID: int32(sh.drv.PID()), SegmentSize: size, Kind: sh.kind}
	for i, h := range hs {
		e, ok := sh.exports[h]
		if !ok {
			var err error
			if e, err = sh.drv.MemExportShareable(s.dev, h, sh.kind); err != nil {
				return SegmentShare{}, 0, s.fail(op, s.exportFailure(i, len(hs), err), err)
			}
			if sh.exports == nil {
				sh.exports = make(map[cuda.MemHandle]cuda.ShareableHandle)
			}
			sh.exports[h] = e
			if e.Kind == cuda.ShareablePOSIXFD {
				sh.fds++
			}
		}
		if sh.kind == cuda.ShareablePOSIXFD {
			out.FDs = append(out.FDs, int32(e.FD))
		} else {
			out.Fabric = append(out.Fabric, e.Fabric)
		}
	}
	return out, off - lo, nil
}

// exportFailure says what failed exporting allocation i of n.
func (s *Space) exportFailure(i, n int, err error) string {
	sh := &s.share
	what := fmt.Sprintf("exporting physical allocation %d of %d on device %d as a %v handle", i+1, n, s.dev, sh.kind)
	if sh.kind == cuda.ShareablePOSIXFD {
		what += fmt.Sprintf(" (exported memory holds %d file descriptors of this process", sh.fds)
		if lim := sh.drv.FDLimit(); lim > 0 {
			what += fmt.Sprintf("; its limit of open files, RLIMIT_NOFILE, is %d: raise it (ulimit -n) or share less at once", lim)
		}
		what += ")"
	}
	return what
}

// Exported returns the number of exported physical allocations and of the
// descriptors they hold.
func (s *Space) Exported() (allocations, fds int) { return len(s.share.exports), s.share.fds }

// released forgets the released handle h's export, closing its
// descriptor; the caller has just released h. A descriptor that does not
// close is reported: it keeps the memory alive until the process exits.
func (s *Space) released(h cuda.MemHandle) {
	sh := &s.share
	e, ok := sh.exports[h]
	if !ok {
		return
	}
	delete(sh.exports, h)
	if e.Kind != cuda.ShareablePOSIXFD {
		return
	}
	sh.fds--
	if err := sh.drv.CloseFD(e.FD); err != nil {
		s.warn(fmt.Sprintf("closing file descriptor %d of a released physical allocation on device %d failed (%v); its memory stays allocated until the process exits", e.FD, s.dev, err))
	}
}
