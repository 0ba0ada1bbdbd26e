// SPDX-License-Identifier: Apache-2.0

package vmem

import (
	"fmt"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// Pausing and resuming tagged memory: the driver's side (the policy, the
// waiting and the copies are the allocator's; the blocks' bookkeeping is
// pools/paused.go's).
//
// A tag's pools (pools.BlockPool.Tag) always grow through a Space, with or
// without expandable_segments, so that their memory can be given back
// without losing its addresses: Pause unmaps and releases every physical
// allocation (chunk) mapped in a segment and records it as paused; Resume
// creates a chunk of the same size for each, maps it at the same offset and
// sets its access as Map does (the device and its peers). The reservation
// and the blocks stay throughout, so pointers and the CUDA graphs that hold
// them stay valid.
//
// Chunks: a tag's large pools map chunks of up to tagChunk bytes, far more
// than the default pools' mapping unit, since a pause and a resume cost a
// few driver calls per chunk (cuMemUnmap and cuMemRelease; cuMemCreate,
// cuMemMap and cuMemSetAccess), and tagged memory (weights, KV caches,
// graph pools) is made of large, long-lived allocations: a 256 MiB tensor
// is one chunk. The cost is that empty_cache gives back only whole chunks of
// a tag's free memory. Tags are never stitched (neither donors nor
// receivers): their pages stay in their own ranges.
//
// Sharing (export.go): a chunk's release forgets its export and closes its
// descriptor, as every release does, and Resume creates chunks as growth
// does (create: shareable once the device's kind is chosen), so that a
// resumed tag's blocks can be shared again. The allocator refuses to pause a
// tag while one of its allocated blocks is exported (pools.Block.Shared):
// what Pause releases is memory no other process is using by protocol.
//
// Failures: Pause unmaps chunk by chunk, and a chunk is recorded as paused
// once its unmap succeeded; a handle whose release fails waits in the
// spares for the next Release (the memory is unmapped either way). Resume
// maps chunk by chunk, from the last; a chunk whose map or access fails is
// given back (as Map gives back a failed mapping) and stays paused. Either
// call may stop part way with an error and be called again: it carries on
// from where it stopped, and nothing is counted twice.

// tagChunk is the most one physical allocation covers in a tag's large
// pools (see above).
const tagChunk = 1 << 30

// VMM reports whether the driver's virtual memory management works on the
// device, probing it once. Unlike Expandable, it warns of nothing: a tag's
// pools without it are ordinary segments, and pausing them fails with its
// own message; Expandable still warns when it probes.
func (s *Space) VMM() bool {
	switch {
	case s.state != 0:
		return s.state == 1
	case s.drv == nil || s.noVMM:
		return false
	}
	g, err := s.drv.MemGranularity(s.dev)
	if err != nil || g == 0 {
		s.noVMM = true
		return false
	}
	s.page = (pools.RoundLarge + g - 1) / g * g // as Expandable
	s.state = 1
	return true
}

// tagged reports whether r is a tag's request.
func tagged(r *pools.Request) bool { return r.Pool.Tag != 0 }

// Pause unmaps and releases every chunk mapped in the expandable segment
// seg, recording it as paused (pools.Cache.PauseChunk), and returns the
// bytes released. The caller has waited for the work queued on the
// segment and holds its capture gate. On an error the chunks already
// paused stay paused and the rest mapped; Pause may be called again.
func (s *Space) Pause(seg *pools.Segment) (uint64, error) {
	page := seg.PageSize
	var released uint64
	for o := uint64(0); o < seg.Size; {
		h := seg.Page(o / page)
		if h == 0 {
			o += page // unmapped, or paused already
			continue
		}
		n := seg.ChunkAt(o)
		p := seg.Base + cuda.Ptr(o)
		if err := s.drv.MemUnmap(s.dev, p, n); err != nil {
			return released, s.fail("pause", fmt.Sprintf("unmapping %d bytes at %#x on device %d (%d bytes released before it; pause again to release the rest)", n, uintptr(p), s.dev, released), err)
		}
		seg.SetChunk(o, n, 0)
		s.cache.PauseChunk(seg, o, n)
		released += n
		if err := s.drv.MemRelease(s.dev, h); err != nil {
			// Unmapped all the same: the handle waits for the next
			// release (empty_cache), which frees its memory.
			s.phys.spare = append(s.phys.spare, physical{h, n})
			s.warn(s.fail("pause", fmt.Sprintf("releasing the %d bytes unmapped at %#x on device %d (they go back at the next empty_cache)", n, uintptr(p), s.dev), err).Error())
		} else {
			s.released(h) // its export, if any, is forgotten (export.go)
		}
		o += n
	}
	return released, nil
}

// Resume maps new memory for every paused chunk of seg, from the last, at
// its offset, and returns the bytes mapped. The caller holds its capture
// gate. On an error the chunks not yet mapped stay paused; Resume may be
// called again.
func (s *Space) Resume(seg *pools.Segment) (uint64, error) {
	s.phys.capturing = false // (Grow's flag: no capture is under way here)
	var mapped uint64
	for len(seg.Paused) > 0 {
		ch := seg.Paused[len(seg.Paused)-1]
		p := seg.Base + cuda.Ptr(ch.Off)
		what := func(doing string) string {
			return fmt.Sprintf("%s %d bytes at %#x on device %d (%d bytes mapped before it; resume again to map the rest)", doing, ch.Size, uintptr(p), s.dev, mapped)
		}
		h, err := s.create(ch.Size) // (shareable as growth's: export.go)
		if err != nil {
			return mapped, s.fail("resume", what("creating physical memory for"), err)
		}
		if err := s.drv.MemMap(s.dev, p, ch.Size, h); err != nil {
			s.phys.dropHandles(s, []physical{{h, ch.Size}})
			return mapped, s.fail("resume", what("mapping"), err)
		}
		if err := s.drv.MemSetAccess(s.dev, p, ch.Size); err != nil {
			// Memory the device cannot reach must not be handed out.
			s.phys.dropPhysical(s, orphan{p, ch.Size, h})
			return mapped, s.fail("resume", what("setting access to"), err)
		}
		seg.SetChunk(ch.Off, ch.Size, h)
		s.cache.ResumeChunk(seg)
		mapped += ch.Size
	}
	return mapped, nil
}
