// SPDX-License-Identifier: Apache-2.0

package allocator

// Pause and resume by tag: a tag's device memory goes back to the driver
// between phases of a program (an inference engine's weights, KV cache and
// CUDA graphs while a trainer runs on the same GPU), and comes back at the
// same addresses.
//
// # Design
//
// Pause (one tag, or every tag) runs under pauser.mu, the one process-wide
// mutex of pausing, and does its work in steps, taking each device's lock
// only for the bookkeeping, so that other tags' mallocs and frees never wait
// for its copies or synchronizations:
//
//  1. Freeze: the tag's state becomes pausing, so that its mallocs are
//     refused ("tag X is paused"); each device's lock, taken after that,
//     orders the store before any later malloc. Under each lock the pause
//     is refused, and the tag unfrozen, while a capture (or an
//     allocate-to-pool phase, which cudapool cannot tell apart) is under
//     way, while a block of the tag is shared with another process
//     (Block.Shared: exported through CUDA IPC in either handle format,
//     until its free; a frozen tag's blocks are not exported: shareable),
//     or when part of its memory is in ordinary segments (a driver without
//     virtual memory management, a MemPool with its own allocator):
//     ErrNotSupported.
//     The same pass lists the tag's segments, the streams that may have work
//     queued on them, and, with keep, its live blocks.
//  2. Wait for the work queued on the tag's memory: each stream its
//     segments were allocated for is synchronized; the device is, instead,
//     when that cannot tell (a block with other streams' uses or pending
//     events, a graph's pool whose replays run on any stream, a driver
//     without per-stream synchronization).
//  3. keep: the live blocks' contents are copied to pinned host memory
//     (vmem.Copier: large asynchronous copies on streams of its own, from a
//     pinned staging area kept for the next pause; release_host_memory
//     frees it).
//  4. Under each device's lock and capture gate, vmem unmaps and releases
//     every mapped chunk of the tag's segments (vmem/pause.go): reserved
//     bytes drop by what was released, paused_bytes rises by as much,
//     allocated bytes stay. The tag is paused.
//
// Resume maps new memory for every paused chunk at its offset (a device
// short of memory first gives back its cache, as a malloc's retry does),
// restores the kept contents, and unfreezes the tag. Resuming a tag that
// is not paused does nothing.
//
// A begin of allocate-to-pool (a capture) counts itself, then waits for
// pauser.mu (a barrier after its device lock): a pause refuses a capture
// already counted, and one counted later begins after the pause ends, so no
// capture runs while memory is copied or unmapped.
//
// Failures leave nothing lost or counted twice, and each call may be made
// again:
//   - A pause that fails before any memory was released (a capture
//     appeared, a synchronization or copy failed) unfreezes the tag: it is
//     usable again, with its contents.
//   - A pause that fails part way through releasing leaves the tag paused,
//     the rest still mapped: pausing it again releases the rest, resuming
//     it maps back what was released (its kept contents are restored
//     whole).
//   - A resume that fails leaves the tag paused: the chunks it mapped stay
//     mapped, and the next resume maps the rest; kept contents stay on the
//     host until a restore succeeds.
//
// Freeing a paused tag's blocks is allowed (they go back to its pools);
// empty_cache and the OOM retry leave a pausing or paused tag's pools
// alone. Pausing a tag already paused only releases what a failed pause
// left mapped: it neither copies nor changes what is kept.

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/vmem"
)

// pauser is the allocator's state of pausing.
type pauser struct {
	// mu serializes pause, resume and release_host_memory; a begin of
	// allocate-to-pool waits for it (shared) before its capture starts.
	mu rankedRWMutex
	// copier keeps contents on the host (nil until the first pause with
	// keep). Guarded by mu.
	copier *vmem.Copier
}

// streamSynchronizer is implemented by drivers that can wait for one
// stream's work (cuda/driver and cuda/sim, as vmem.CopyDriver).
type streamSynchronizer interface {
	StreamSynchronize(dev int, s cuda.Stream) error
}

// devicePause is what a pause found on one device (step 1).
type devicePause struct {
	segs    []*pools.Segment
	streams []cuda.Stream // to synchronize; nil with syncAll
	syncAll bool          // synchronize the device instead
	// live: with keep, each tag's live blocks, by tag id.
	live map[uint32][]vmem.CopyRange
}

// Pause gives back the device memory of tag (every tag when tag is ""),
// keeping the contents of its live blocks on the host if keep (see the file
// comment). A tag never pushed is an error.
func (a *Allocator) Pause(tag string, keep bool) error {
	const op = "pause"
	a.pauser.mu.Lock()
	defer a.pauser.mu.Unlock()
	ts, err := a.tagsFor(op, tag)
	if err != nil || len(ts) == 0 {
		return err
	}
	// 1. Freeze and look.
	var fresh []*tagInfo // tags this pause freezes (others are paused already)
	for _, t := range ts {
		if t.state.Load() == tagActive {
			t.state.Store(tagPausing)
			fresh = append(fresh, t)
		}
	}
	thaw := func() {
		for _, t := range fresh {
			t.state.Store(tagActive)
		}
	}
	want := tagSet(ts)
	plans := make([]devicePause, len(a.devs))
	for _, d := range a.devs {
		d.enter()
		err := d.pausePlan(op, want, keep, &plans[d.id])
		d.leave()
		if err != nil {
			thaw()
			return err
		}
	}
	// 2. Wait for the work queued on the memory.
	for _, d := range a.devs {
		if err := d.waitQueued(op, &plans[d.id]); err != nil {
			thaw()
			return err
		}
	}
	// 3. Keep the contents of the tags this pause freezes.
	if keep {
		if err := a.saveContents(op, fresh, plans); err != nil {
			thaw()
			return err
		}
	}
	// 4. Release.
	var released uint64
	for _, d := range a.devs {
		n, err := d.pauseRelease(op, want)
		released += n
		if err != nil {
			if released == 0 {
				a.discard(fresh)
				thaw()
				return err
			}
			for _, t := range ts {
				t.state.Store(tagPaused)
			}
			return fmt.Errorf("%w (tag %s is paused: pause it again to release the rest, or resume it)", err, tagList(ts))
		}
	}
	for _, t := range ts {
		t.state.Store(tagPaused)
	}
	return nil
}

// Resume maps new memory at the addresses of tag's paused memory (every
// paused tag when tag is ""), restores the contents its pause kept, and
// lets it allocate again. A tag that is not paused is left alone; a tag
// never pushed is an error.
func (a *Allocator) Resume(tag string) error {
	const op = "resume"
	a.pauser.mu.Lock()
	defer a.pauser.mu.Unlock()
	ts, err := a.tagsFor(op, tag)
	if err != nil {
		return err
	}
	paused := ts[:0:0]
	for _, t := range ts {
		if t.state.Load() == tagPaused {
			paused = append(paused, t)
		}
	}
	if len(paused) == 0 {
		return nil
	}
	want := tagSet(paused)
	for _, d := range a.devs {
		if err := d.resumeMap(op, want); err != nil {
			return err
		}
	}
	// Every device has the memory back: each tag is ready once its
	// contents are.
	for _, t := range paused {
		if t.saved != nil {
			if err := a.pauser.copier.Restore(t.saved); err != nil {
				return &Error{Op: op, Kind: ErrDriver, Err: err, Msg: fmt.Sprintf(
					"restoring the contents of tag %q (its memory is mapped again and the tag stays paused; resume again to retry)", t.name)}
			}
			t.saved = nil
		}
		t.state.Store(tagActive)
	}
	return nil
}

// tagsFor returns the tag named name, or every tag for "".
func (a *Allocator) tagsFor(op, name string) ([]*tagInfo, error) {
	if name == "" {
		return a.allTags(), nil
	}
	t, err := a.tagNamed(op, name)
	if err != nil {
		return nil, err
	}
	return []*tagInfo{t}, nil
}

// tagSet returns the ids of ts as a set (by id).
func tagSet(ts []*tagInfo) map[uint32]bool {
	m := make(map[uint32]bool, len(ts))
	for _, t := range ts {
		m[t.id] = true
	}
	return m
}

// tagList names ts for messages.
func tagList(ts []*tagInfo) string {
	names := make([]string, len(ts))
	for i, t := range ts {
		names[i] = fmt.Sprintf("%q", t.name)
	}
	return strings.Join(names, ", ")
}

// tagSegments returns d's segments of the tags in want. d.mu is held.
func (d *device) tagSegments(want map[uint32]bool) []*pools.Segment {
	var out []*pools.Segment
	for _, s := range d.cache.Segments() {
		if s.Pool.Tag != 0 && want[s.Pool.Tag] {
			out = append(out, s)
		}
	}
	return out
}

// shareable is the pause side of exporting the allocated block b to
// another process (ipc.go, share.go): it refuses a block of a tag that is
// paused or being paused, whose memory is, or is about to be, given back
// (a pause under way checked the tag's blocks before this export). A
// successful export then sets b.Shared, which makes a pause of the tag
// refuse until b is freed (pausePlan; Release clears it). The tag's state
// changes before a pause takes any device lock, and both run under d.mu,
// so either the pause sees the mark or the export sees the state. d.mu is
// held.
func (d *device) shareable(op string, b *pools.Block) error {
	if t := d.a.tag(b.Pool.Tag); t != nil && t.state.Load() != tagActive {
		return newError(op, ErrPaused, "pointer %#x on device %d belongs to tag %q, which is paused or being paused; resume it before sharing its memory",
			uintptr(b.Ptr), d.id, t.name)
	}
	return nil
}

// pausePlan is step 1 on d: the refusals, and what the later steps need.
// d.mu is held.
func (d *device) pausePlan(op string, want map[uint32]bool, keep bool, pl *devicePause) error {
	pl.segs = d.tagSegments(want)
	if len(pl.segs) == 0 {
		return nil
	}
	if d.capturing() {
		return newError(op, ErrCaptureUnderway, "device %d: a CUDA graph capture (or an allocate-to-pool phase, such as use_mem_pool) is under way; pause after it ends", d.id)
	}
	streams := map[cuda.Stream]bool{}
	if keep {
		pl.live = map[uint32][]vmem.CopyRange{}
	}
	var run uint64 // numbers the mapped runs (vmem.CopyRange.Seg)
	for _, s := range pl.segs {
		name := d.a.TagName(s.Pool.Tag)
		for b := s.Head; b != nil; b = b.Next {
			if b.Shared && b.Allocated {
				return newError(op, ErrInUse, "tag %q: the block at %#x on device %d is shared with another process (CUDA IPC) and may be in use there; it cannot be paused until it is freed",
					name, uintptr(b.Ptr), d.id)
			}
		}
		if !s.Expandable {
			why := "the CUDA driver has no virtual memory management API"
			if d.sourceOf(s.Pool) != nil {
				why = "its pool gets memory from a segment source (MemPool(allocator=...)), which cudapool cannot unmap"
			}
			return newError(op, ErrNotSupported, "tag %q holds a %d-byte ordinary segment at %#x on device %d, which cannot be paused: %s",
				name, s.Size, uintptr(s.Base), d.id, why)
		}
		if !s.Pool.ID.IsDefault() {
			pl.syncAll = true // a graph's replays run on any stream
		}
		streams[s.Stream] = true
		run++
		for b := s.Head; b != nil; b = b.Next {
			if b.Unmapped {
				run++ // the copies may merge gaps within a run only
				continue
			}
			if b.EventCount > 0 || !b.Uses.Empty() {
				pl.syncAll = true // used by other streams
			}
			if keep && b.Allocated && !b.Held {
				t := s.Pool.Tag
				pl.live[t] = append(pl.live[t], vmem.CopyRange{Dev: d.id, Ptr: b.Ptr, Size: b.Size, Seg: run})
			}
		}
	}
	if _, ok := d.drv.(streamSynchronizer); !ok {
		pl.syncAll = true
	}
	if !pl.syncAll {
		for s := range streams {
			pl.streams = append(pl.streams, s)
		}
		sort.Slice(pl.streams, func(i, j int) bool { return pl.streams[i] < pl.streams[j] })
	}
	return nil
}

// waitQueued is step 2 on d, without its lock: the synchronizations do not
// touch the device's state, and other tags' mallocs need not wait for them.
func (d *device) waitQueued(op string, pl *devicePause) error {
	if len(pl.segs) == 0 {
		return nil
	}
	if pl.syncAll {
		if err := d.drv.DeviceSynchronize(d.id); err != nil {
			return driverError(op, err, "synchronizing device %d before pausing its memory", d.id)
		}
		return nil
	}
	ss := d.drv.(streamSynchronizer)
	for _, s := range pl.streams {
		if err := ss.StreamSynchronize(d.id, s); err != nil {
			return driverError(op, err, "synchronizing stream %#x of device %d before pausing its memory", uintptr(s), d.id)
		}
	}
	return nil
}

// copier returns the allocator's Copier, made at the first pause with
// keep. pauser.mu is held.
func (a *Allocator) copier(op string) (*vmem.Copier, error) {
	if c := a.pauser.copier; c != nil {
		return c, nil
	}
	cd, ok := a.drv.(vmem.CopyDriver)
	if !ok {
		return nil, newError(op, ErrNotSupported, "the CUDA driver in use has no pinned host memory and asynchronous copies; pause with keep is not supported (pause without it)")
	}
	a.pauser.copier = vmem.NewCopier(cd, vmem.CopyOptions{})
	return a.pauser.copier, nil
}

// saveContents is step 3: the live blocks of each tag in ts, on every
// device, go to the host. On an error nothing is kept.
func (a *Allocator) saveContents(op string, ts []*tagInfo, plans []devicePause) error {
	if len(ts) == 0 {
		return nil
	}
	c, err := a.copier(op)
	if err != nil {
		return err
	}
	for _, t := range ts {
		var ranges []vmem.CopyRange
		for dev := range plans {
			ranges = append(ranges, plans[dev].live[t.id]...)
		}
		saved, err := c.Save(ranges)
		if err != nil {
			a.discard(ts)
			return &Error{Op: op, Kind: ErrDriver, Err: err, Msg: fmt.Sprintf("keeping the contents of tag %q on the host (nothing was paused)", t.name)}
		}
		t.saved = saved
	}
	return nil
}

// discard gives back the host memory the tags in ts kept. pauser.mu is
// held.
func (a *Allocator) discard(ts []*tagInfo) {
	for _, t := range ts {
		if t.saved != nil {
			_ = a.pauser.copier.Discard(t.saved) // (only fails for a Saved of another Copier)
			t.saved = nil
		}
	}
}

// pauseRelease is step 4 on d: every mapped chunk of the tags in want is
// unmapped and released. It returns the bytes released.
func (d *device) pauseRelease(op string, want map[uint32]bool) (uint64, error) {
	d.enter()
	defer d.leave()
	segs := d.tagSegments(want)
	if len(segs) == 0 {
		return 0, nil
	}
	if !d.enterUnsafe() {
		return 0, newError(op, ErrCaptureUnderway, "device %d: a CUDA graph capture began while the memory was being paused; pause after it ends", d.id)
	}
	defer d.leaveUnsafe()
	var released uint64
	for _, s := range segs {
		n, err := d.vm.Pause(s)
		released += n
		if err != nil {
			return released, err
		}
	}
	if d.debug {
		d.mustCheck()
	}
	return released, nil
}

// resumeMap maps new memory for the paused chunks of the tags in want on
// d. Short of memory, it gives back d's cache (as a malloc's retry does)
// and tries again.
func (d *device) resumeMap(op string, want map[uint32]bool) error {
	d.enter()
	defer d.leave()
	segs := d.tagSegments(want)
	if len(segs) == 0 {
		return nil
	}
	if !d.enterUnsafe() {
		return newError(op, ErrCaptureUnderway, "device %d: a CUDA graph capture is under way; resume after it ends", d.id)
	}
	defer d.leaveUnsafe()
	retried := false
	for i := 0; i < len(segs); i++ {
		_, err := d.vm.Resume(segs[i])
		if err == nil {
			continue
		}
		if !errors.Is(err, cuda.ErrOutOfMemory) {
			return err
		}
		if !retried {
			retried = true
			if rerr := d.releaseCached(op); rerr != nil {
				return rerr
			}
			i-- // this segment again
			continue
		}
		var paused uint64
		for _, s := range segs {
			paused += s.PausedBytes
		}
		return &Error{Op: op, Kind: ErrOutOfMemory, Err: err, Msg: fmt.Sprintf(
			"out of memory: device %d has too little free memory to map back %s of paused memory, after giving back cudapool's cache; free memory and resume again",
			d.id, FormatSize(paused))}
	}
	if d.debug {
		d.mustCheck()
	}
	return nil
}

// PausedBytes returns the device memory of dev that pauses gave back and
// no resume has mapped again.
func (a *Allocator) PausedBytes(dev int) (uint64, error) {
	return onDevice(a, "paused_bytes", dev, func(d *device) (uint64, error) {
		var n uint64
		for _, s := range d.cache.Segments() {
			n += s.PausedBytes
		}
		return n, nil
	})
}

// Paused returns the paused tags, in the order they were named.
func (a *Allocator) Paused() []TagState {
	var out []TagState
	for _, t := range a.tagStates() {
		if t.Paused {
			out = append(out, t)
		}
	}
	return out
}

// ReleaseHostMemory frees the pinned host memory kept for copies that no
// paused tag holds, and the copy streams, and returns the bytes freed.
func (a *Allocator) ReleaseHostMemory() (uint64, error) {
	const op = "release_host_memory"
	a.pauser.mu.Lock()
	defer a.pauser.mu.Unlock()
	c := a.pauser.copier
	if c == nil {
		return 0, nil
	}
	before := c.Stats().Pooled
	err := c.Close()
	freed := before - c.Stats().Pooled
	if err != nil {
		return freed, &Error{Op: op, Kind: ErrDriver, Err: err, Msg: "freeing pinned host memory and copy streams (what failed is kept and freed by the next call)"}
	}
	return freed, nil
}

// HostMemoryStats returns the pinned host memory of pausing (vmem.CopyStats).
func (a *Allocator) HostMemoryStats() vmem.CopyStats {
	a.pauser.mu.Lock()
	defer a.pauser.mu.Unlock()
	if c := a.pauser.copier; c != nil {
		return c.Stats()
	}
	return vmem.CopyStats{}
}

// TagState is a tag as snapshots show it (allocator_settings' "tags"):
// its name, whether it is paused, and its device memory given back, by
// device.
type TagState struct {
	Tag         string   `json:"tag"`
	Paused      bool     `json:"paused"`
	PausedBytes []uint64 `json:"paused_bytes"`
}

// tagStates returns every tag's state, in the order they were named.
func (a *Allocator) tagStates() []TagState {
	ts := a.allTags()
	out := make([]TagState, len(ts))
	for i, t := range ts {
		out[i] = TagState{Tag: t.name, Paused: t.state.Load() == tagPaused, PausedBytes: make([]uint64, len(a.devs))}
	}
	if len(ts) == 0 {
		return out
	}
	for _, d := range a.devs {
		d.enter()
		for _, s := range d.cache.Segments() {
			if s.Pool.Tag != 0 && int(s.Pool.Tag) <= len(out) {
				out[s.Pool.Tag-1].PausedBytes[d.id] += s.PausedBytes
			}
		}
		d.leave()
	}
	return out
}
