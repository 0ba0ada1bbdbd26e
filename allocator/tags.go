// SPDX-License-Identifier: Apache-2.0

package allocator

// Tags: memory that can be paused and resumed as a whole (pause.go).
//
// # Design
//
// A tag is a name (cudapool_tag_push, cudapool.region) that a thread's
// allocations carry while it is pushed. The C entry points keep each
// thread's stack of tags (capi/cudapool.c) and pass the top's id with every
// malloc (MallocRequest.Tag); Go alone knows what the id means. Ids come
// from the table below, made on the cold path (TagID), and are never
// reused: a tag lives as long as the process.
//
// A tag's memory comes from pools of its own on each device (tagPools: a
// small and a large pool, like the default ones, made at the tag's first
// malloc on the device), whose pools.BlockPool.Tag names the tag. Their
// segments are always expandable ones (vmem, with or without
// expandable_segments), so that a pause can give their physical memory
// back and a resume map new memory at the same addresses; best fit never
// leaves a pool, and stitching never takes or gives a tag's pages, so one
// tag's memory never holds another's. Where the driver has no virtual
// memory management, a tag's pools hold ordinary segments and pausing them
// is refused (ErrNotSupported).
//
// Captures: a private pool begun by a thread under a tag (a
// torch.cuda.graph, a torch.compile graph tree's pool, a MemPool's
// use_mem_pool, BeginAllocateToPoolTagged) belongs to that tag, and so
// does the automatic pool of a capture nobody announced, made by a tagged
// malloc: the graph's memory is paused and resumed with the tag. A pool
// keeps the tag it first had; a private pool's allocations follow the pool,
// whatever tag the allocating thread has.
//
// A tagged malloc skips the front cache (its C side passes the tag only to
// Go) and its block is never tracked there: Malloc sends it down its rare
// path (mallocElse), which refuses a paused tag's malloc under the device
// lock.

import (
	"sync/atomic"
	"unicode/utf8"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/vmem"
)

// A tag's state (tagInfo.state). Mallocs are served only while it is
// active; pause and resume change it under Allocator.pauser.mu.
const (
	tagActive  uint32 = iota
	tagPausing        // a pause is under way: mallocs are refused
	tagPaused         // paused (all of its memory, or, after a failed pause, part of it)
)

// MaxTags bounds the number of tags a process may name; MaxTagName the
// length of a name in bytes.
const (
	MaxTags    = 1 << 16
	MaxTagName = 256
)

// tagInfo is one tag, the same on every device.
type tagInfo struct {
	id    uint32
	name  string
	state atomic.Uint32 // tagActive, tagPausing or tagPaused
	// saved holds the contents the pause under way or in force kept
	// (keep), until the resume restores them; nil: none. Guarded by
	// Allocator.pauser.mu.
	saved *vmem.Saved
}

// tagTable names the tags of an Allocator.
type tagTable struct {
	mu     rankedMutex         // guards byName and the growth of list
	byName map[string]*tagInfo // guarded by mu
	// list holds the tags by id-1; readers load it without a lock (a new
	// tag replaces the slice).
	list atomic.Pointer[[]*tagInfo]
}

// TagID returns the id of the tag named name, naming a new tag on its first
// use. A name is 1 to MaxTagName bytes of UTF-8 without NUL characters.
func (a *Allocator) TagID(name string) (uint32, error) {
	const op = "tag_push"
	switch {
	case name == "":
		return 0, newError(op, ErrInvalidArgument, "the tag is empty")
	case len(name) > MaxTagName:
		return 0, newError(op, ErrInvalidArgument, "the tag is %d bytes long; at most %d", len(name), MaxTagName)
	case !utf8.ValidString(name):
		return 0, newError(op, ErrInvalidArgument, "the tag %q is not UTF-8", name)
	}
	t := &a.tags
	t.mu.Lock()
	defer t.mu.Unlock()
	if ti := t.byName[name]; ti != nil {
		return ti.id, nil
	}
	var list []*tagInfo
	if l := t.list.Load(); l != nil {
		list = *l
	}
	if len(list) >= MaxTags {
		return 0, newError(op, ErrInvalidArgument, "%d tags are named already (at most %d per process); tag %q is one too many", len(list), MaxTags, name)
	}
	ti := &tagInfo{id: uint32(len(list) + 1), name: name}
	next := append(list[:len(list):len(list)], ti)
	if t.byName == nil {
		t.byName = make(map[string]*tagInfo)
	}
	t.byName[name] = ti
	t.list.Store(&next)
	return ti.id, nil
}

// TagName returns the name of tag id ("" for none).
func (a *Allocator) TagName(id uint32) string {
	if t := a.tag(id); t != nil {
		return t.name
	}
	return ""
}

// tag returns tag id, or nil.
func (a *Allocator) tag(id uint32) *tagInfo {
	l := a.tags.list.Load()
	if l == nil || id == 0 || uint64(id) > uint64(len(*l)) {
		return nil
	}
	return (*l)[id-1]
}

// allTags returns every tag named so far.
func (a *Allocator) allTags() []*tagInfo {
	if l := a.tags.list.Load(); l != nil {
		return *l
	}
	return nil
}

// tagNamed returns the tag named name, or op's error for a name never
// pushed.
func (a *Allocator) tagNamed(op, name string) (*tagInfo, error) {
	t := &a.tags
	t.mu.Lock()
	ti := t.byName[name]
	t.mu.Unlock()
	if ti == nil {
		return nil, newError(op, ErrInvalidArgument, "no tag is named %q (a tag is named by the first cudapool_tag_push or cudapool.region of it)", name)
	}
	return ti, nil
}

// pausedError is the malloc's error for tag t, which is paused (or being
// paused).
//
//go:noinline
func pausedError(op string, t *tagInfo) error {
	return newError(op, ErrPaused, "tag %q is paused; resume it (cudapool_resume, cudapool.resume) before allocating from it", t.name)
}

// deviceTags is a device's side of the tags. Guarded by device.mu.
type deviceTags struct {
	pools []tagPools // by tag id - 1; zero until the tag first allocates here
	// cur is the tag of the malloc in progress, which an automatic private
	// pool that Route makes for it takes (device.newPools).
	cur uint32
}

// tagPools are a tag's default pools on a device.
type tagPools struct{ small, large *pools.BlockPool }

// tagPools returns tag id's pools on d, making them at its first malloc
// here. d.mu is held.
func (d *device) tagPools(id uint32) tagPools {
	dt := &d.tags
	if i := int(id) - 1; i < len(dt.pools) && dt.pools[i].large != nil {
		return dt.pools[i]
	}
	for len(dt.pools) < int(id) {
		dt.pools = append(dt.pools, tagPools{})
	}
	tp := tagPools{small: d.cache.NewPool(true, PoolID{}), large: d.cache.NewPool(false, PoolID{})}
	tp.small.Tag, tp.large.Tag = id, id
	dt.pools[id-1] = tp
	return tp
}

// mallocTagged is malloc (device.go) for a thread under tag id: the tag's
// pools instead of the default ones, unless a capture routes the request
// to its private pool; refused while the tag is paused. d.mu is held.
func (d *device) mallocTagged(size uint64, s cuda.Stream, capture uint64, id uint32) (cuda.Ptr, error) {
	t := d.a.tag(id)
	if t == nil {
		return 0, newError("malloc", ErrInvalidArgument, "no tag has id %d", id)
	}
	if t.state.Load() != tagActive {
		return 0, pausedError("malloc", t)
	}
	tp := d.tagPools(id)
	small, large := tp.small, tp.large
	capturing := false
	if capture != 0 || !d.graphs.Idle() || d.counted != 0 || d.a.underway.Load() > 0 || !d.ev.Idle() {
		d.tags.cur = id
		rs, rl, c := d.mallocSetup(s, capture)
		d.tags.cur = 0
		capturing = c
		if d.front.routed {
			small, large = rs, rl
		}
	}
	var r pools.Request
	d.cache.SetRequest(&r, size, s, small, large)
	b, err := d.take(&r, capturing)
	if err != nil {
		return 0, err
	}
	d.front.tag = TagNone // a tag's blocks are Go's alone
	b.Context = 0
	if d.rec != nil {
		d.rec.allocated(b, s)
	}
	return b.Ptr, nil
}

// tagPool gives the private pool id, which a thread under tag (0: none)
// begins, its tag, or refuses the begin: a pool keeps the tag it first had
// (a begin under no tag keeps it), a pool holding untagged memory takes
// none, and a paused tag's pool begins no capture. d.mu is held; the begin
// is not yet done.
func (d *device) tagPool(op string, id PoolID, tag uint32) error {
	have := uint32(0)
	pp := d.graphs.Pools.Get(id)
	if pp != nil {
		have = pp.Large.Tag
	}
	switch {
	case tag != 0 && have != 0 && tag != have:
		return newError(op, ErrInvalidArgument, "pool {%d,%d} on device %d belongs to tag %q; it cannot be begun under tag %q",
			id.A, id.B, d.id, d.a.TagName(have), d.a.TagName(tag))
	case tag != 0 && have == 0 && pp != nil && pp.Segments() > 0:
		return newError(op, ErrInvalidArgument, "pool {%d,%d} on device %d holds memory allocated under no tag; it cannot be begun under tag %q",
			id.A, id.B, d.id, d.a.TagName(tag))
	}
	if have == 0 {
		have = tag
	}
	if t := d.a.tag(have); t != nil && t.state.Load() != tagActive {
		return newError(op, ErrPaused, "pool {%d,%d} on device %d belongs to tag %q, which is paused; resume it before capturing into the pool",
			id.A, id.B, d.id, t.name)
	}
	return nil
}

// BeginAllocateToPoolTagged is BeginAllocateToPool for a thread under tag
// (0: none; TagID names it): a new pool, or one holding nothing, becomes
// the tag's (see the file comment).
func (a *Allocator) BeginAllocateToPoolTagged(dev int, id PoolID, tag uint32, filter func(cuda.Stream) bool) error {
	const op = "begin_allocate_to_pool"
	if tag != 0 && a.tag(tag) == nil {
		return newError(op, ErrInvalidArgument, "no tag has id %d", tag)
	}
	err := a.withDevice(op, dev, func(d *device) error {
		if err := d.tagPool(op, id, tag); err != nil {
			return err
		}
		if err := d.graphs.Begin(id, filter, d.newPools); err != nil {
			return poolError(op, err)
		}
		if pp := d.graphs.Pools.Get(id); tag != 0 && pp.Large.Tag == 0 {
			pp.Small.Tag, pp.Large.Tag = tag, tag
		}
		d.pushPhases()
		a.announced.Store(true)
		d.countCaptures()
		// The capture is counted: wait for the unsafe sections of the
		// other devices that began before it was, so that none is still
		// freeing memory or querying events when the caller begins
		// capturing.
		a.gate.Lock()
		//lint:ignore SA2001 an empty critical section: a barrier
		a.gate.Unlock()
		return nil
	})
	if err == nil {
		// And for a pause or resume under way (pause.go), which may be
		// copying or unmapping outside any device lock.
		a.pauser.mu.RLock()
		//lint:ignore SA2001 a barrier, as the gate above
		a.pauser.mu.RUnlock()
	}
	return err
}

// tagActive reports whether tag (0: none) is active: neither pausing nor
// paused, so that its pools' free memory may be given back.
func (a *Allocator) tagActive(tag uint32) bool {
	t := a.tag(tag)
	return t == nil || t.state.Load() == tagActive
}

// releaseTags gives back the cached memory of d's tags that are active
// (releaseCached's part; a paused or pausing tag's pools are left alone).
// d.mu is held and the gate.
func (d *device) releaseTags(op string) error {
	for _, tp := range d.tags.pools {
		if tp.large == nil || !d.a.tagActive(tp.large.Tag) {
			continue
		}
		for _, p := range [2]*pools.BlockPool{tp.large, tp.small} {
			if err := d.cache.ReleasePool(p, d.freeSeg); err != nil {
				return driverError(op, err, "freeing the cached segments of tag %q on device %d", d.a.TagName(p.Tag), d.id)
			}
			if err := d.vm.UnmapFree(p); err != nil {
				return driverError(op, err, "unmapping the free pages of tag %q on device %d", d.a.TagName(p.Tag), d.id)
			}
			d.cache.MarkReleased(p)
		}
	}
	return nil
}

// tagsReleasable reports whether an active tag's pools on d may hold
// memory that releaseTags would give back. d.mu is held.
func (d *device) tagsReleasable() bool {
	for _, tp := range d.tags.pools {
		if tp.large != nil && (tp.large.Releasable() || tp.small.Releasable()) && d.a.tagActive(tp.large.Tag) {
			return true
		}
	}
	return false
}
