// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// Memory history: PyTorch's torch.cuda.memory._record_memory_history.
//
// # Design
//
// PyTorch gives its allocator a context recorder, a function that captures
// the caller's Python (and C++) stack as an opaque object. Only C++ can call
// it, so the work is split: the caller (the C++ layer) gathers a context
// when GatherMask says the operation about to run needs one, keeps the
// object in a table under a non-zero integer id, and passes the id to a
// request (MallocRequest.Ctx, FreeRequest.Ctx) or to EmptyCache. Everything
// else is decided here: which contexts are kept,
// on what, which actions are recorded, the ring's size, skip_actions,
// clearing, user metadata, compile contexts and annotations. LiveContexts
// tells the caller which ids are still referenced, so it can drop the rest.
//
// The rules, as in native PyTorch (c10/cuda/CUDACachingAllocator.cpp), by
// level (HistoryLevel, PyTorch's RecordContext):
//
//   - malloc gathers a context from level state up (GatherAlloc); free and
//     empty_cache only at level all (GatherFree, GatherRelease). A context
//     passed for an operation whose level does not ask for one is ignored,
//     so a caller racing with RecordHistory cannot break these rules.
//   - From level state up, an allocated block keeps its malloc's context
//     until its free completes, and a segment keeps the context of the
//     malloc that allocated it (for an expandable segment: that mapped its
//     first page) for as long as it lives. Snapshots show both.
//   - Trace entries carry a context only from level alloc up: the context of
//     the operation that caused them, else the one of what they concern.
//     alloc and oom: the malloc's. free_requested: the free's, else the
//     block's. free_completed: the context of the operation during which the
//     free completed (the free itself; or, for a block whose other streams'
//     uses ended later, the malloc or empty_cache that noticed), else the
//     block's. segment_alloc and segment_map: the malloc's.
//     segment_free and segment_unmap: the operation's (the malloc that
//     retries after freeing cached memory, or empty_cache at level all),
//     else the segment's. snapshot: none.
//   - Trace entries record the compile context on top of the stack
//     (PushCompileContext; "N/A" when empty) and the user metadata in force.
//     Both are shared by all the entries made while they hold: an entry
//     holds a pointer to them, not a copy.
//   - Sizes are PyTorch's: the requested size for alloc, free_requested and
//     free_completed; the rounded size for oom, whose addr is the device's
//     free memory; the segment or mapped size for segment entries; the
//     active bytes of the snapshot for snapshot entries, which each snapshot
//     records after reading the trace (so the next snapshot shows it).
//   - Disabling clears the trace and the annotations; blocks and segments
//     keep the contexts they have (they still describe them).
//
// Differences from native, all because Go cannot see the caller's threads
// nor its current device: user metadata and the compile-context stack are
// the allocator's, not the calling thread's and current device's; and the
// segment context survives the segment's first block being split (native
// keeps it on the head block and loses it when the head is split off).
//
// The device does not know these rules: it tells its recorder what happens
// (recorder.go), and has none while the history is off, which costs the
// malloc and free paths one test each. Each device's recorder keeps its
// trace in a ring (deviceHistory, guarded by the device's lock), which grows
// as entries come, up to MaxEntries, so that a huge limit (Python's default
// is sys.maxsize) costs only what is used; once full, each entry overwrites
// the oldest. Recording an entry allocates nothing beyond the ring's
// growth. The entries one operation makes share its time, read once (the
// clock is the dearest part of recording).
// The allocator-wide state (labels, annotations, the gather mask) is in
// history. Lock order: history.mu before any device's lock (lockrank.go).

// HistoryLevel says which contexts are kept (PyTorch's RecordContext).
type HistoryLevel int

// The levels, in increasing order of what is kept.
const (
	HistoryNever HistoryLevel = iota // no contexts
	HistoryState                     // contexts of live blocks and segments
	HistoryAlloc                     // also on trace entries
	HistoryAll                       // also the contexts of frees and empty_cache
)

var levelNames = [...]string{"never", "state", "alloc", "all"}

func (l HistoryLevel) String() string {
	if l >= 0 && int(l) < len(levelNames) {
		return levelNames[l]
	}
	return fmt.Sprintf("HistoryLevel(%d)", int(l))
}

// HistoryOptions are RecordHistory's arguments (PyTorch's recordHistory).
type HistoryOptions struct {
	Enabled bool
	// MaxEntries bounds each device's trace; trace entries are kept only
	// when it is positive and Enabled.
	MaxEntries int
	// When says which contexts are kept (HistoryNever when not Enabled).
	When HistoryLevel
	// Clear drops the trace entries and annotations recorded so far.
	Clear bool
	// SkipActions names actions not to record: "alloc", "free_requested",
	// "free_completed", "segment_alloc", "segment_free", "segment_map",
	// "segment_unmap", "snapshot", "oom".
	SkipActions []string
}

// The operations GatherMask can ask a context for.
const (
	GatherAlloc   uint32 = 1 << iota // malloc (MallocRequest.Ctx)
	GatherFree                       // free (FreeRequest.Ctx)
	GatherRelease                    // empty_cache (EmptyCache's ctx)
)

// history is the memory history: the allocator-wide part, and each
// device's recorder (devs, by device id: the device's rec while the
// history is on).
type history struct {
	gather  atomic.Uint32                 // GatherMask
	enabled atomic.Bool                   // written under mu
	labels  atomic.Pointer[historyLabels] // what new trace entries record; written under mu
	devs    []*deviceHistory              // each guarded by its device's lock

	mu          rankedMutex
	compile     []string              // the compile-context stack; guarded by mu
	user        string                // the user metadata; guarded by mu
	annotations ring[AnnotationEntry] // guarded by mu
}

// historyLabels are the compile context and user metadata in force. They are
// never modified: a change publishes a new one.
type historyLabels struct {
	compile string
	user    string
}

// publish makes new trace entries record the current labels. h.mu is held.
func (h *history) publish() {
	l := &historyLabels{compile: "N/A", user: h.user}
	if n := len(h.compile); n > 0 {
		l.compile = h.compile[n-1]
	}
	h.labels.Store(l)
}

// RecordHistory starts, changes or stops the memory history (PyTorch's
// recordHistory). Invalid options change nothing.
func (a *Allocator) RecordHistory(o HistoryOptions) error {
	if o.When < HistoryNever || o.When > HistoryAll {
		return newError("record_history", ErrInvalidArgument, "history level %d: expected %d (never), %d (state), %d (alloc) or %d (all)",
			int(o.When), HistoryNever, HistoryState, HistoryAlloc, HistoryAll)
	}
	if o.MaxEntries < 0 {
		return newError("record_history", ErrInvalidArgument, "max entries %d is negative", o.MaxEntries)
	}
	skip, err := parseSkipActions(o.SkipActions)
	if err != nil {
		return err
	}
	level, entries := o.When, o.MaxEntries
	if !o.Enabled {
		level, entries = HistoryNever, 0
	}
	clear := !o.Enabled || o.Clear
	h := &a.hist
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, d := range a.devs {
		d.enter()
		dh := h.devs[d.id]
		if clear {
			dh.ring.clear()
		}
		dh.ring.setMax(entries)
		dh.level, dh.skip, dh.on = level, skip, entries > 0
		d.rec = nil
		if dh.on || dh.level > HistoryNever {
			d.rec = dh
		}
		d.leave()
	}
	if clear {
		h.annotations.clear()
	}
	h.annotations.setMax(entries)
	h.enabled.Store(o.Enabled)
	a.front.sync()
	var mask uint32
	if level >= HistoryState {
		mask |= GatherAlloc
	}
	if level >= HistoryAll {
		mask |= GatherFree | GatherRelease
	}
	h.gather.Store(mask)
	return nil
}

func parseSkipActions(names []string) (uint32, error) {
	var skip uint32
	for _, n := range names {
		i := slices.Index(actionNames[:], n)
		if i < 0 {
			return 0, newError("record_history", ErrInvalidArgument, "skip_actions: unknown action %q (known: %s)", n, strings.Join(actionNames[:], ", "))
		}
		skip |= 1 << i
	}
	return skip, nil
}

// HistoryEnabled reports whether the memory history is on.
func (a *Allocator) HistoryEnabled() bool { return a.hist.enabled.Load() }

// GatherMask says for which operations (GatherAlloc, GatherFree,
// GatherRelease) the caller should gather a context now and pass its id.
func (a *Allocator) GatherMask() uint32 { return a.hist.gather.Load() }

// SetUserMetadata sets the string that trace entries record as
// user_metadata from now on (torch.cuda.memory._set_memory_metadata).
func (a *Allocator) SetUserMetadata(s string) {
	a.hist.mu.Lock()
	a.hist.user = s
	a.hist.publish()
	a.hist.mu.Unlock()
}

// UserMetadata returns the string set by SetUserMetadata.
func (a *Allocator) UserMetadata() string {
	a.hist.mu.Lock()
	defer a.hist.mu.Unlock()
	return a.hist.user
}

// PushCompileContext makes s the compile context that trace entries record
// until the matching PopCompileContext. Ignored while history is off, as in
// PyTorch.
func (a *Allocator) PushCompileContext(s string) {
	h := &a.hist
	h.mu.Lock()
	if h.enabled.Load() {
		h.compile = append(h.compile, s)
		h.publish()
	}
	h.mu.Unlock()
}

// PopCompileContext drops the compile context pushed last, if any. Ignored
// while history is off.
func (a *Allocator) PopCompileContext() {
	h := &a.hist
	h.mu.Lock()
	if n := len(h.compile); n > 0 && h.enabled.Load() {
		h.compile[n-1] = ""
		h.compile = h.compile[:n-1]
		h.publish()
	}
	h.mu.Unlock()
}

// RecordAnnotation records an external annotation (key/value pairs, a later
// key overriding an earlier one) for device dev, as PyTorch's
// recordAnnotation does for record_function scopes; snapshots return the
// last MaxEntries of them. Ignored while history is off.
func (a *Allocator) RecordAnnotation(dev int, kv [][2]string) error {
	if _, err := a.device("record_annotation", dev); err != nil {
		return err
	}
	h := &a.hist
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.enabled.Load() {
		return nil
	}
	md := make([][2]string, 0, len(kv))
	for _, p := range kv {
		if i := slices.IndexFunc(md, func(q [2]string) bool { return q[0] == p[0] }); i >= 0 {
			md[i][1] = p[1]
			continue
		}
		md = append(md, p)
	}
	h.annotations.push(AnnotationEntry{Device: dev, TimeUS: time.Now().UnixMicro(), Metadata: md})
	return nil
}

// AnnotationEntry is one external annotation. It renders as PyTorch's dict:
// the metadata keys, then "device" and "time_us".
type AnnotationEntry struct {
	Device   int
	TimeUS   int64
	Metadata [][2]string
}

// MarshalJSON renders the entry as one flat object. A metadata key named
// device or time_us takes precedence, as in PyTorch's dict.
func (e AnnotationEntry) MarshalJSON() ([]byte, error) {
	b := []byte{'{'}
	has := func(k string) bool {
		return slices.ContainsFunc(e.Metadata, func(p [2]string) bool { return p[0] == k })
	}
	field := func(k string, v any) error {
		if len(b) > 1 {
			b = append(b, ',')
		}
		kj, err := json.Marshal(k)
		if err != nil {
			return err
		}
		vj, err := json.Marshal(v)
		if err != nil {
			return err
		}
		b = append(append(append(b, kj...), ':'), vj...)
		return nil
	}
	for _, p := range e.Metadata {
		if err := field(p[0], p[1]); err != nil {
			return nil, err
		}
	}
	if !has("device") {
		if err := field("device", e.Device); err != nil {
			return nil, err
		}
	}
	if !has("time_us") {
		if err := field("time_us", e.TimeUS); err != nil {
			return nil, err
		}
	}
	return append(b, '}'), nil
}

// LiveContexts appends to dst every context id still referenced by a block,
// a segment or a trace entry, sorted and without duplicates, and returns the
// extended slice. Every other id the caller handed over may be dropped; ids
// the caller holds for operations it has not yet passed (queued frees) are
// its own to keep.
func (a *Allocator) LiveContexts(dst []uint64) []uint64 {
	start := len(dst)
	for _, d := range a.devs {
		d.enter()
		for _, s := range d.cache.Segments() {
			if s.Context != 0 {
				dst = append(dst, s.Context)
			}
			for b := s.Head; b != nil; b = b.Next {
				if b.Context != 0 {
					dst = append(dst, b.Context)
				}
			}
		}
		a.hist.devs[d.id].ring.each(func(e *traceEntry) {
			if e.ctx != 0 {
				dst = append(dst, e.ctx)
			}
		})
		d.leave()
	}
	slices.Sort(dst[start:])
	return dst[:start+len(slices.Compact(dst[start:]))]
}

// ring keeps the last max values pushed. Its storage grows as values come,
// up to max, so a large bound costs only what is used.
type ring[T any] struct {
	buf  []T
	next int // once full (len(buf) == max): the oldest value, overwritten next
	max  int
}

func (r *ring[T]) push(v T) {
	if r.max <= 0 {
		return
	}
	if len(r.buf) < r.max {
		if len(r.buf) == cap(r.buf) {
			nb := make([]T, len(r.buf), min(r.max, max(2*cap(r.buf), 64)))
			copy(nb, r.buf)
			r.buf = nb
		}
		r.buf = append(r.buf, v)
		return
	}
	r.buf[r.next] = v
	if r.next++; r.next == len(r.buf) {
		r.next = 0
	}
}

// each calls fn on every value, oldest first.
func (r *ring[T]) each(fn func(*T)) {
	for i := r.next; i < len(r.buf); i++ {
		fn(&r.buf[i])
	}
	for i := 0; i < r.next; i++ {
		fn(&r.buf[i])
	}
}

// clear drops every value, keeping the storage.
func (r *ring[T]) clear() {
	clear(r.buf)
	r.buf, r.next = r.buf[:0], 0
}

// setMax changes the bound, keeping the newest values that fit. A bound of
// zero releases the storage.
func (r *ring[T]) setMax(n int) {
	if n == r.max {
		return
	}
	var kept []T
	r.each(func(v *T) { kept = append(kept, *v) })
	kept = kept[max(0, len(kept)-n):]
	r.buf, r.next, r.max = nil, 0, n
	if len(kept) > 0 {
		r.buf = kept
	}
}
