// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

type action uint8

const (
	actionAlloc action = iota
	actionFreeRequested
	actionFreeCompleted
	actionSegmentAlloc
	actionSegmentFree
	actionOOM
	actionSegmentMap   // pages of an expandable segment mapped
	actionSegmentUnmap // pages of an expandable segment unmapped
	actionSnapshot     // a snapshot was taken (size: its active bytes)
)

var actionNames = [...]string{"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "segment_map", "segment_unmap", "snapshot"}

// traceEntry is one recorded action (see history.go).
type traceEntry struct {
	action action
	addr   cuda.Ptr // for oom: the device's free memory
	size   uint64
	stream cuda.Stream
	timeUS int64
	pool   PoolID
	ctx    uint64
	labels *historyLabels // shared with the other entries made meanwhile
}

// Snapshot is torch.cuda.memory._snapshot()'s shape; encoding/json renders
// it as PyTorch's dict. Context fields carry the ids the caller passed to the
// requests and EmptyCache (see history.go); the caller turns them into frames.
type Snapshot struct {
	Segments            []SegmentInfo     `json:"segments"`
	DeviceTraces        [][]TraceEntry    `json:"device_traces"`
	AllocatorSettings   map[string]any    `json:"allocator_settings"`
	ExternalAnnotations []AnnotationEntry `json:"external_annotations"`
}

// SegmentInfo describes one segment.
type SegmentInfo struct {
	Device        int       `json:"device"`
	Address       uint64    `json:"address"`
	TotalSize     uint64    `json:"total_size"`
	AllocatedSize uint64    `json:"allocated_size"`
	ActiveSize    uint64    `json:"active_size"`
	RequestedSize uint64    `json:"requested_size"`
	Stream        uint64    `json:"stream"`
	SegmentType   string    `json:"segment_type"`
	SegmentPoolID [2]uint64 `json:"segment_pool_id"`
	IsExpandable  bool      `json:"is_expandable"`
	// Context is the context of the malloc that allocated the segment (for
	// an expandable segment: mapped its first page, shown on the mapped run
	// at its start); 0: none.
	Context uint64      `json:"context,omitempty"`
	Frames  []any       `json:"frames"`
	Blocks  []BlockInfo `json:"blocks"`
	// Tag is the tag whose memory the segment holds (tags.go; absent for
	// none). Paused: a pause gave its physical memory back (pause.go); the
	// blocks are as they were, and come back at the same addresses.
	Tag    string `json:"tag,omitempty"`
	Paused bool   `json:"paused,omitempty"`
}

// BlockInfo describes one block of a segment.
type BlockInfo struct {
	Address       uint64 `json:"address"`
	Size          uint64 `json:"size"`
	RequestedSize uint64 `json:"requested_size"`
	State         string `json:"state"`
	// Allocated and Active are PyTorch's BlockInfo flags: handed to the
	// user; allocated or awaiting its free.
	Allocated bool `json:"allocated"`
	Active    bool `json:"active"`
	// Context is the context of the malloc that allocated the block, kept
	// until its free completes; 0: none.
	Context uint64 `json:"context,omitempty"`
	Frames  []any  `json:"frames"`
}

// TraceEntry is one recorded allocator action.
type TraceEntry struct {
	Action string `json:"action"`
	Addr   uint64 `json:"addr"`
	Size   uint64 `json:"size"`
	Stream uint64 `json:"stream"`
	TimeUS int64  `json:"time_us"` // microseconds since the Unix epoch
	// Device and PoolID are the device and the pool of the block or
	// segment concerned (for snapshot entries: the pool asked for).
	Device int       `json:"device"`
	PoolID [2]uint64 `json:"pool_id"`
	// Context is the context recorded with the action (level alloc and
	// above); 0: none.
	Context        uint64 `json:"context,omitempty"`
	CompileContext string `json:"compile_context"`
	UserMetadata   string `json:"user_metadata"`
	Frames         []any  `json:"frames"`
	// DeviceFree is set on oom entries only.
	DeviceFree *uint64 `json:"device_free,omitempty"`
}

// Snapshot returns the segments and blocks of pool (nil: of every pool) on
// every device, with the recorded traces and annotations if includeTraces
// (else device_traces and external_annotations are empty). Each device
// records a snapshot entry after its trace is read, as PyTorch does.
func (a *Allocator) Snapshot(pool *PoolID, includeTraces bool) Snapshot {
	snap := Snapshot{
		Segments:            []SegmentInfo{},
		DeviceTraces:        [][]TraceEntry{},
		ExternalAnnotations: []AnnotationEntry{},
	}
	var asked PoolID
	if pool != nil {
		asked = *pool
	}
	if includeTraces {
		snap.DeviceTraces = make([][]TraceEntry, len(a.devs))
		a.hist.mu.Lock()
		a.hist.annotations.each(func(e *AnnotationEntry) { snap.ExternalAnnotations = append(snap.ExternalAnnotations, *e) })
		a.hist.mu.Unlock()
	}
	var tr []traceEntry
	for _, d := range a.devs {
		tr = tr[:0]
		d.enter()
		if includeTraces {
			a.hist.devs[d.id].ring.each(func(e *traceEntry) { tr = append(tr, *e) })
		}
		first := len(snap.Segments)
		for _, s := range d.cache.Segments() {
			if pool == nil || s.Pool.ID == *pool {
				snap.Segments = appendSegmentInfo(snap.Segments, d.id, s, a.TagName(s.Pool.Tag))
			}
		}
		var active uint64
		for _, si := range snap.Segments[first:] {
			active += si.ActiveSize
		}
		if d.rec != nil {
			d.rec.snapshot(active, asked)
		}
		d.leave()
		if includeTraces {
			snap.DeviceTraces[d.id] = traceEntries(d.id, tr)
		}
	}
	remaps, lent, syncs := make([]int64, len(a.devs)), make([]int64, len(a.devs)), make([]int64, len(a.devs))
	for i, d := range a.devs {
		d.enter()
		st := d.vm.StitchStats()
		remaps[i], lent[i], syncs[i] = st.Remaps, st.Lent, st.Syncs
		d.leave()
	}
	cfg := a.Config()
	p := cfg.Pools
	maxSplit := int64(-1)
	if p.MaxSplitSize != pools.Unlimited {
		maxSplit = int64(p.MaxSplitSize)
	}
	snap.AllocatorSettings = map[string]any{
		"PYTORCH_CUDA_ALLOC_CONF":      cfg.String(),
		"max_split_size":               maxSplit,
		"garbage_collection_threshold": p.GCThreshold,
		"expandable_segments":          cfg.ExpandableSegments,
		"roundup_power2_divisions":     p.RoundupDivisions,
		"record_history":               cfg.HistoryEntries,
		// cudapool's own: stitching and each device's count of pages
		// moved, of those lent, and of the synchronizations that
		// certified other streams' pages idle (vmem/stitch.go).
		"stitch":                 cfg.Stitch,
		"stitch_chunk_mb":        cfg.StitchChunk >> 20,
		"expandable_map_unit_mb": cfg.ExpandableMapUnit >> 20,
		"stitch_remaps":          remaps,
		"stitch_lent":            lent,
		"stitch_syncs":           syncs,
		// The tags and their state (tags.go, pause.go).
		"tags": a.tagStates(),
	}
	return snap
}

// traceEntries renders device dev's recorded entries.
func traceEntries(dev int, tr []traceEntry) []TraceEntry {
	out := make([]TraceEntry, len(tr))
	for i, e := range tr {
		out[i] = TraceEntry{Action: actionNames[e.action], Addr: uint64(e.addr), Size: e.size,
			Stream: uint64(e.stream), TimeUS: e.timeUS, Device: dev, PoolID: [2]uint64{e.pool.A, e.pool.B},
			Context: e.ctx, Frames: []any{}}
		if e.labels != nil {
			out[i].CompileContext, out[i].UserMetadata = e.labels.compile, e.labels.user
		}
		if e.action == actionOOM {
			free := uint64(e.addr)
			out[i].Addr, out[i].DeviceFree = 0, &free
		}
	}
	return out
}

// appendSegmentInfo describes s: one segment, or for an expandable segment
// one per contiguous mapped run (PyTorch's convention; unmapped space is not
// memory and its blocks are not shown).
func appendSegmentInfo(out []SegmentInfo, dev int, s *pools.Segment, tag string) []SegmentInfo {
	typ := "large"
	if s.Pool.Small {
		typ = "small"
	}
	var si *SegmentInfo
	for b := s.Head; b != nil; b = b.Next {
		if b.Unmapped {
			si = nil
			continue
		}
		if si == nil {
			out = append(out, SegmentInfo{Device: dev, Address: uint64(b.Ptr), Stream: uint64(s.Stream), SegmentType: typ,
				SegmentPoolID: [2]uint64{s.Pool.ID.A, s.Pool.ID.B}, IsExpandable: s.Expandable, Frames: []any{},
				Tag: tag, Paused: s.PausedBytes > 0})
			si = &out[len(out)-1]
			if b.Ptr == s.Base {
				si.Context = s.Context
			}
		}
		state := "inactive"
		switch {
		case b.Allocated:
			state = "active_allocated"
			si.AllocatedSize += b.Size
		case b.Active():
			state = "active_awaiting_free"
		}
		if b.Active() {
			si.ActiveSize += b.Size
			si.RequestedSize += b.Requested
		}
		si.TotalSize += b.Size
		si.Blocks = append(si.Blocks, BlockInfo{Address: uint64(b.Ptr), Size: b.Size, RequestedSize: b.Requested,
			State: state, Allocated: b.Allocated, Active: b.Active(), Context: b.Context, Frames: []any{}})
	}
	return out
}
