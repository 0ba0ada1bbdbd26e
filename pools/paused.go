// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"fmt"
	"slices"
)

// Paused memory: the blocks' side of pausing memory by tag (the driver work
// is vmem/pause.go's, the policy the allocator's).
//
// A pause gives the physical memory of an expandable segment back to the
// driver while leaving every block as it was: allocated blocks stay
// allocated (their addresses, and the CUDA graphs that hold them, stay
// valid), free blocks stay free, and the address range stays reserved.
// Each physical allocation (chunk) it unmaps and releases is listed in
// Segment.Paused, its pages hold no handle (Segment.Page is 0 there,
// under mapped blocks), and its bytes move from Reserved (and
// reserved_bytes) to Segment.PausedBytes. A resume maps new memory at the
// same offsets and moves them back. Segment.Mapped keeps counting them: it
// is the blocks' view of the range.
//
// Nothing else here touches a segment with paused chunks: the allocator
// neither allocates from a paused tag's pools nor releases their memory
// (UnmapFree, TrimUnused), and stitching takes pages from the default
// pools only.

// Chunk is a range of a segment, [Off, Off+Size) from its base.
type Chunk struct{ Off, Size uint64 }

// PauseChunk records that the chunk [off, off+size) of the expandable
// segment seg, under mapped blocks, was unmapped and released by a pause
// (its pages' handles are already 0).
func (c *Cache) PauseChunk(seg *Segment, off, size uint64) {
	i := len(seg.Paused)
	for i > 0 && seg.Paused[i-1].Off > off {
		i--
	}
	seg.Paused = slices.Insert(seg.Paused, i, Chunk{off, size})
	seg.PausedBytes += size
	c.Reserved -= size
	c.Stats.ReservedBytes.Decrease(seg.Pool.Small, int64(size))
	c.Stats.NumDeviceFree++
}

// ResumeChunk records that the last paused chunk of seg was mapped again
// (its pages' handles set): it holds memory again.
func (c *Cache) ResumeChunk(seg *Segment) {
	ch := seg.Paused[len(seg.Paused)-1]
	seg.Paused = seg.Paused[:len(seg.Paused)-1]
	if len(seg.Paused) == 0 {
		seg.Paused = nil
	}
	seg.PausedBytes -= ch.Size
	c.Reserved += ch.Size
	c.Stats.ReservedBytes.Increase(seg.Pool.Small, int64(ch.Size))
	c.Stats.NumDeviceAlloc++
}

// checkPaused verifies seg's paused chunks (sorted, disjoint, whole pages,
// with no handle, summing to PausedBytes) and returns which pages they
// cover (nil: none).
func checkPaused(s *Segment) ([]bool, error) {
	if len(s.Paused) == 0 {
		if s.PausedBytes != 0 {
			return nil, fmt.Errorf("segment %#x: %d paused bytes, no paused chunk", s.Base, s.PausedBytes)
		}
		return nil, nil
	}
	if !s.Expandable {
		return nil, fmt.Errorf("segment %#x: paused chunks in an ordinary segment", s.Base)
	}
	paused := make([]bool, s.PageCount())
	var sum, end uint64
	for _, ch := range s.Paused {
		if ch.Size == 0 || ch.Off%s.PageSize != 0 || ch.Size%s.PageSize != 0 || ch.Off < end || ch.Off+ch.Size > s.Size {
			return nil, fmt.Errorf("segment %#x: bad paused chunk %+v", s.Base, ch)
		}
		for o := ch.Off; o < ch.Off+ch.Size; o += s.PageSize {
			i := o / s.PageSize
			if s.Page(i) != 0 {
				return nil, fmt.Errorf("segment %#x: paused page %d has handle %d", s.Base, i, s.Page(i))
			}
			paused[i] = true
		}
		sum += ch.Size
		end = ch.Off + ch.Size
	}
	if sum != s.PausedBytes {
		return nil, fmt.Errorf("segment %#x: paused chunks sum to %d bytes, PausedBytes %d", s.Base, sum, s.PausedBytes)
	}
	return paused, nil
}
