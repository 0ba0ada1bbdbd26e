package allocator

import (
	"time"

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
)

var actionNames = [...]string{"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "segment_map", "segment_unmap"}

type traceEntry struct {
	action action
	addr   cuda.Ptr
	size   uint64
	stream cuda.Stream
	timeUS int64
	free   uint64 // device free memory, for oom entries
}

// traceRing keeps the last N allocator actions of a device. Its storage is
// allocated when history is switched on, so recording allocates nothing.
type traceRing struct {
	buf  []traceEntry
	next int // where the next entry goes
	full bool
}

func (t *traceRing) on() bool { return len(t.buf) > 0 }

func (t *traceRing) resize(n int) {
	if n == len(t.buf) {
		return
	}
	old := t.entries()
	t.buf, t.next, t.full = nil, 0, false
	if n > 0 {
		t.buf = make([]traceEntry, n)
		for _, e := range old[max(0, len(old)-n):] {
			t.push(e)
		}
	}
}

func (t *traceRing) add(a action, addr cuda.Ptr, size uint64, s cuda.Stream) {
	if len(t.buf) == 0 {
		return
	}
	t.push(traceEntry{a, addr, size, s, time.Now().UnixMicro(), 0})
}

// addOOM records an out-of-memory event with the device's free memory,
// which PyTorch's memory visualizer reads.
func (t *traceRing) addOOM(size uint64, s cuda.Stream, free uint64) {
	if len(t.buf) == 0 {
		return
	}
	t.push(traceEntry{actionOOM, 0, size, s, time.Now().UnixMicro(), free})
}

func (t *traceRing) push(e traceEntry) {
	t.buf[t.next] = e
	t.next++
	if t.next == len(t.buf) {
		t.next, t.full = 0, true
	}
}

func (t *traceRing) entries() []traceEntry {
	if !t.full {
		return append([]traceEntry(nil), t.buf[:t.next]...)
	}
	return append(append([]traceEntry(nil), t.buf[t.next:]...), t.buf[:t.next]...)
}

// Snapshot is torch.cuda.memory._snapshot()'s shape; encoding/json renders
// it as PyTorch's dict.
type Snapshot struct {
	Segments            []SegmentInfo  `json:"segments"`
	DeviceTraces        [][]TraceEntry `json:"device_traces"`
	AllocatorSettings   map[string]any `json:"allocator_settings"`
	ExternalAnnotations []any          `json:"external_annotations"`
}

// SegmentInfo describes one segment.
type SegmentInfo struct {
	Device        int         `json:"device"`
	Address       uint64      `json:"address"`
	TotalSize     uint64      `json:"total_size"`
	AllocatedSize uint64      `json:"allocated_size"`
	ActiveSize    uint64      `json:"active_size"`
	RequestedSize uint64      `json:"requested_size"`
	Stream        uint64      `json:"stream"`
	SegmentType   string      `json:"segment_type"`
	SegmentPoolID [2]uint64   `json:"segment_pool_id"`
	IsExpandable  bool        `json:"is_expandable"`
	Frames        []any       `json:"frames"`
	Blocks        []BlockInfo `json:"blocks"`
}

// BlockInfo describes one block of a segment.
type BlockInfo struct {
	Address       uint64 `json:"address"`
	Size          uint64 `json:"size"`
	RequestedSize uint64 `json:"requested_size"`
	State         string `json:"state"`
	Frames        []any  `json:"frames"`
}

// TraceEntry is one recorded allocator action.
type TraceEntry struct {
	Action string `json:"action"`
	Addr   uint64 `json:"addr"`
	Size   uint64 `json:"size"`
	Stream uint64 `json:"stream"`
	TimeUS int64  `json:"time_us"`
	Frames []any  `json:"frames"`
	// DeviceFree is set on oom entries only.
	DeviceFree *uint64 `json:"device_free,omitempty"`
}

// Snapshot returns every device's segments and blocks and the recorded
// traces.
func (a *Allocator) Snapshot() Snapshot {
	snap := Snapshot{
		Segments:            []SegmentInfo{},
		DeviceTraces:        make([][]TraceEntry, len(a.devs)),
		ExternalAnnotations: []any{},
	}
	for _, d := range a.devs {
		d.mu.Lock()
		for _, s := range d.cache.Segments() {
			snap.Segments = appendSegmentInfo(snap.Segments, d.id, s)
		}
		tr := d.trace.entries()
		d.mu.Unlock()
		out := make([]TraceEntry, len(tr))
		for i, e := range tr {
			out[i] = TraceEntry{Action: actionNames[e.action], Addr: uint64(e.addr), Size: e.size,
				Stream: uint64(e.stream), TimeUS: e.timeUS, Frames: []any{}}
			if e.action == actionOOM {
				out[i].DeviceFree = &tr[i].free
			}
		}
		snap.DeviceTraces[d.id] = out
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
	}
	return snap
}

// appendSegmentInfo describes s: one segment, or for an expandable segment
// one per contiguous mapped run (PyTorch's convention; unmapped space is not
// memory and its blocks are not shown).
func appendSegmentInfo(out []SegmentInfo, dev int, s *pools.Segment) []SegmentInfo {
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
				SegmentPoolID: [2]uint64{s.Pool.ID.A, s.Pool.ID.B}, IsExpandable: s.Expandable, Frames: []any{}})
			si = &out[len(out)-1]
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
			State: state, Frames: []any{}})
	}
	return out
}
