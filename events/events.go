// SPDX-License-Identifier: Apache-2.0

// Package events delays the return of freed blocks that other streams still
// use, with CUDA events, as PyTorch's caching allocator does.
//
// record_stream adds a stream to a block's uses. When such a block is freed,
// Insert records one event on each use stream and the block waits, holding a
// count of outstanding events, until Process sees all of them complete; only
// then does it go back to its pool. Each stream has its own FIFO of pending
// events, queried front to back, so a long-running stream does not hold up
// blocks waiting on others.
//
// During a CUDA graph capture no event may be queried or synchronized, and
// an event recorded on a capturing stream could not be queried later, so a
// block freed then is deferred (Defer) and its events are recorded by the
// first Process after the last capture ends.
//
// # Stream progress
//
// The same per-stream queues answer "has stream S run past point T?", the
// question stitching asks before it unmaps a free page that work queued on
// its stream may still touch (vmem). A point is a tick of the caller's
// clock (pools.Cache.Tick, the clock that stamps Block.FreedAt). Advance
// records a mark, an event without a block, right after a tick; once a mark
// has completed, every point below its tick is behind the stream (Passed).
// A mark goes on the stream of the caller's request, the one stream known
// to exist at that moment, and on the legacy default stream, which always
// exists (and is the same stream on every thread): a stream named in an
// earlier call may have been destroyed since (CuPy's and Numba's streams
// come and go while memory allocated on them lives on), and naming a
// destroyed stream to the driver is undefined behaviour (the driver reads
// the freed stream, and crashes). So other streams learn their progress
// from marks recorded at their own requests: at their own misses
// (Advance), and at any request of theirs after a caller found their free
// blocks uncertified (WantMark, MarkWanted), so that a stream whose
// requests all hit its cache still lets its idle pages go. After the
// caller synchronizes the device, Synchronized certifies every watched
// stream at once, naming none. Events recorded on a stream stay valid
// after it is destroyed: pending marks are still queried.
// Marks and frees' events share the queues, the event pool and the
// draining: events on one stream complete in order, so a stream's queue is
// read from the front, whoever recorded the entries.
// Marks are advisory: one that cannot be created, recorded or queried only
// leaves its stream's progress where it was (and stays pending, queried
// again at the next Advance); Synchronize drops the marks it meets without
// waiting for them, and ResetProgress forgets what they certified. At most
// MarkDepth marks wait on one stream.
//
// A Tracker belongs to one device and is guarded by that device's lock.
package events

import (
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
)

// RecordUse notes that s uses b. Uses by the allocating stream need no event.
func RecordUse(b *pools.Block, s cuda.Stream) {
	if s != b.Stream {
		b.Uses.Add(s)
	}
}

// pending is an event recorded on a stream: a free's (b set), or a mark
// (b nil) recorded right after the caller's clock reached at.
type pending struct {
	ev cuda.Event
	b  *pools.Block
	at uint64
}

// MarkDepth bounds the marks pending on one stream.
const MarkDepth = 8

// queue is one stream's pending events in record order, and what its
// completed marks certified.
type queue struct {
	items []pending
	head  int
	marks int // pending marks among items
	// passed is the tick of the last mark seen complete: the stream has
	// run past every point below it (0: nothing known).
	passed  uint64
	watched bool // Advance keeps a mark pending here
}

// Tracker holds a device's pending frees. The owner's lock guards it.
type Tracker struct {
	drv   Driver
	dev   int
	spare []cuda.Event // event pool: created events ready for reuse
	// broken holds events that failed a query and then failed to be
	// destroyed: never reused, destroyed again by DestroySpare.
	broken   []cuda.Event
	queues   map[cuda.Stream]*queue
	deferred []*pools.Block // frees waiting for the end of all captures
	pending  int            // frees' events in all queues (marks not counted)
	created  int            // events created and not destroyed
	watched  int            // streams watched (Watch)
	// want holds the streams to mark at their next request (WantMark):
	// few at a time, scanned on every malloc while any is there.
	want []cuda.Stream
	// progress: some queue may have marks or a passed point, which
	// ResetProgress forgets (false once it has, until a mark is recorded).
	progress bool
}

// New returns a tracker for device dev.
func New(drv Driver, dev int) *Tracker {
	return &Tracker{drv: drv, dev: dev, queues: make(map[cuda.Stream]*queue)}
}

// Idle reports whether no free is pending. It is the cheap test the malloc
// hot path makes before calling Process.
func (t *Tracker) Idle() bool { return t.pending == 0 && len(t.deferred) == 0 }

// Empty reports whether no event is alive (pending, pooled or broken), no
// free is deferred and no stream's progress is known: nothing for
// Synchronize, DestroySpare or ResetProgress to do. A watched stream with
// no mark recorded since the last ResetProgress holds nothing (stitching,
// on by default, watches its streams for the allocator's life).
func (t *Tracker) Empty() bool { return t.created == 0 && len(t.deferred) == 0 && !t.progress }

// Pending returns the number of outstanding events and deferred blocks.
func (t *Tracker) Pending() (events, deferred int) { return t.pending, len(t.deferred) }

// EventsCreated is the number of driver events alive (pooled or pending).
func (t *Tracker) EventsCreated() int { return t.created }

// Defer parks a freed block with uses until no capture is under way.
func (t *Tracker) Defer(b *pools.Block) { t.deferred = append(t.deferred, b) }

// Reclaim takes b back out of the deferred frees, for a caller that has
// proved its uses over by other means (the capture graph's topology, see
// graphs/reuse.go). It reports whether b was deferred; b keeps
// its uses for the caller to clear.
func (t *Tracker) Reclaim(b *pools.Block) bool {
	for i, d := range t.deferred {
		if d == b {
			t.deferred = append(t.deferred[:i], t.deferred[i+1:]...)
			return true
		}
	}
	return false
}

// Insert records an event on each of b's use streams and queues b behind
// them. b must have uses and no events yet. If recording fails, the streams
// not yet covered stay in b.Uses and b is deferred to be tried again, so the
// block is never returned early and never lost.
func (t *Tracker) Insert(b *pools.Block) error {
	var uses [8]cuda.Stream
	streams := uses[:0]
	b.Uses.Each(func(s cuda.Stream) { streams = append(streams, s) })
	b.Uses.Clear()
	for i, s := range streams {
		ev, err := t.event()
		if err == nil {
			if err = t.drv.EventRecord(t.dev, ev, s); err != nil {
				t.spare = append(t.spare, ev)
			}
		}
		if err != nil {
			for _, rest := range streams[i:] {
				b.Uses.Add(rest)
			}
			if b.EventCount == 0 {
				t.Defer(b)
			}
			return err
		}
		q := t.queue(s)
		q.items = append(q.items, pending{ev: ev, b: b})
		b.EventCount++
		t.pending++
	}
	return nil
}

// queue returns s's queue, made on first use.
func (t *Tracker) queue(s cuda.Stream) *queue {
	q := t.queues[s]
	if q == nil {
		q = &queue{}
		t.queues[s] = q
	}
	return q
}

func (t *Tracker) event() (cuda.Event, error) {
	if n := len(t.spare); n > 0 {
		ev := t.spare[n-1]
		t.spare = t.spare[:n-1]
		return ev, nil
	}
	ev, err := t.drv.EventCreate(t.dev)
	if err == nil {
		t.created++
	}
	return ev, err
}

// Process returns to the caller (through done) every block whose events
// have all completed. It first records the events of deferred frees, so it
// must only be called while no capture is under way.
func (t *Tracker) Process(done func(*pools.Block)) error {
	if err := t.insertDeferred(); err != nil {
		return err
	}
	return t.drain(t.query, done)
}

// query is drain's test in Process and Advance.
func (t *Tracker) query(ev cuda.Event) (bool, error) { return t.drv.EventQuery(t.dev, ev) }

// Synchronize waits for every pending event and returns all waiting blocks
// (PyTorch's synchronize_and_free_events). Not during capture.
func (t *Tracker) Synchronize(done func(*pools.Block)) error {
	if err := t.insertDeferred(); err != nil {
		return err
	}
	return t.drain(nil, done)
}

func (t *Tracker) insertDeferred() error {
	if len(t.deferred) == 0 {
		return nil
	}
	blocks := t.deferred
	t.deferred = nil
	for i, b := range blocks {
		if err := t.Insert(b); err != nil {
			// Keep the rest for the next try; Insert already re-deferred b
			// if it recorded nothing.
			t.deferred = append(t.deferred, blocks[i+1:]...)
			return err
		}
	}
	return nil
}

// drain pops completed events from the front of each stream's queue;
// complete nil: synchronize every free's event (Synchronize).
//
// An event the driver cannot query (one recorded into a capture nobody
// announced, or on a stream of another context) is dropped, and its stream
// goes back into the block's uses, so that the block is deferred and a
// fresh event is recorded for it: one bad event never blocks the queue, and
// the block is still never returned early. The first such error is
// returned after everything else was processed.
func (t *Tracker) drain(complete func(cuda.Event) (bool, error), done func(*pools.Block)) error {
	if t.pending == 0 {
		return nil
	}
	var first error
	for s, q := range t.queues {
		if err := t.drainQueue(s, q, complete, done); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// drainQueue is drain for stream s's queue q.
func (t *Tracker) drainQueue(s cuda.Stream, q *queue, complete func(cuda.Event) (bool, error), done func(*pools.Block)) error {
	var first error
	for q.head < len(q.items) {
		p := q.items[q.head]
		if p.b == nil {
			if !t.markDone(q, p, complete) {
				break
			}
			continue
		}
		var ok bool
		var err error
		if complete == nil {
			ok, err = true, t.drv.EventSynchronize(t.dev, p.ev)
		} else {
			ok, err = complete(p.ev)
		}
		if !ok && err == nil {
			break
		}
		q.items[q.head] = pending{}
		q.head++
		t.pending--
		if err != nil {
			if first == nil {
				first = err
			}
			if t.drv.EventDestroy(t.dev, p.ev) == nil {
				t.created--
			} else {
				t.broken = append(t.broken, p.ev)
			}
			p.b.Uses.Add(s)
		} else {
			t.spare = append(t.spare, p.ev)
		}
		p.b.EventCount--
		if p.b.EventCount == 0 {
			if p.b.Uses.Empty() {
				done(p.b)
			} else {
				// Some stream still needs an event: record it anew.
				t.Defer(p.b)
			}
		}
	}
	switch {
	case q.head == len(q.items):
		// Keep the emptied queue and its storage for the stream's next frees.
		q.items, q.head = q.items[:0], 0
	case q.head > len(q.items)/2:
		// A stream that always has an event outstanding never empties
		// its queue: compact it so that it does not grow without bound.
		n := copy(q.items, q.items[q.head:])
		clear(q.items[n:])
		q.items, q.head = q.items[:n], 0
	}
	return first
}

// markDone pops the mark p at the front of q if it has completed (then the
// stream has passed its tick), and reports whether it did. complete nil
// (Synchronize): the mark is dropped unexamined. A failed query leaves the
// mark pending, its stream uncertified until a later query.
func (t *Tracker) markDone(q *queue, p pending, complete func(cuda.Event) (bool, error)) bool {
	if complete != nil {
		if ok, err := complete(p.ev); !ok || err != nil {
			return false
		}
		// A mark recorded before a synchronization completes after it:
		// it certifies no more than Synchronized already did.
		q.passed = max(q.passed, p.at)
	}
	q.items[q.head] = pending{}
	q.head++
	q.marks--
	t.spare = append(t.spare, p.ev)
	return true
}

// Clock is the caller's clock, whose ticks are the points marks certify.
type Clock interface {
	// Tick advances the clock and returns its new value.
	Tick() uint64
}

// Watch makes Advance follow s: drain its queue, and mark it when s is the
// request's stream (or the legacy default stream).
func (t *Tracker) Watch(s cuda.Stream) {
	if q := t.queue(s); !q.watched {
		q.watched = true
		t.watched++
	}
}

// Watching reports whether any stream is watched.
func (t *Tracker) Watching() bool { return t.watched > 0 }

// Watched reports whether s is watched.
func (t *Tracker) Watched(s cuda.Stream) bool {
	q := t.queues[s]
	return q != nil && q.watched
}

// Passed reports whether stream s is known to have run past point at: a
// mark recorded after a tick above at has completed.
func (t *Tracker) Passed(s cuda.Stream, at uint64) bool {
	q := t.queues[s]
	return q != nil && at < q.passed
}

// Advance brings the watched streams' progress up to date: it pops the
// completed events at the front of their queues (the blocks of frees whose
// events are all complete go to done, as in Process). Then it records a new
// mark right after a tick of c on rs, the stream of the caller's request,
// and on the legacy default stream (0), if they are watched: no other
// stream is named to the driver (see the package comment). Never during a
// capture.
func (t *Tracker) Advance(c Clock, rs cuda.Stream, recordable func(cuda.Stream) bool, done func(*pools.Block)) {
	if t.watched == 0 {
		return
	}
	for s, q := range t.queues {
		if q.watched {
			// Errors of frees' events are Process's to report: it meets
			// them again (their blocks are deferred for new events).
			_ = t.drainQueue(s, q, t.query, done)
		}
	}
	t.mark(c, rs, recordable, done)
	t.unwant(rs)
	if rs != 0 {
		t.mark(c, 0, recordable, done)
		t.unwant(0)
	}
}

// mark records a mark on s right after a tick of c, unless s is not
// watched, MarkDepth marks are pending there or recordable refuses s (a
// capturing stream's events would be captured, not recorded); on a stream
// with nothing else pending it asks at once whether the mark has completed
// (on an idle stream it has). A failure only leaves s's progress where it
// was.
func (t *Tracker) mark(c Clock, s cuda.Stream, recordable func(cuda.Stream) bool, done func(*pools.Block)) {
	q := t.queues[s]
	if q == nil || !q.watched || q.marks == MarkDepth || !recordable(s) {
		return
	}
	ev, err := t.event()
	if err != nil {
		return
	}
	at := c.Tick()
	if t.drv.EventRecord(t.dev, ev, s) != nil {
		t.spare = append(t.spare, ev)
		return
	}
	q.items = append(q.items, pending{ev: ev, at: at})
	q.marks++
	t.progress = true
	if len(q.items)-q.head == 1 {
		_ = t.drainQueue(s, q, t.query, done)
	}
}

// maxWanted bounds Tracker.want: a stream asked for beyond it is marked at
// its own next miss, as before it was asked for.
const maxWanted = 8

// WantMark asks that watched stream s be marked at its next request
// (MarkWanted): a caller met free blocks of s that no completed mark
// certifies. s is not named to the driver here (see the package comment).
func (t *Tracker) WantMark(s cuda.Stream) {
	if q := t.queues[s]; q != nil && q.watched && !t.WantedOn(s) && len(t.want) < maxWanted {
		t.want = append(t.want, s)
	}
}

// Wanted reports whether some stream waits for a mark at its next request:
// the test the malloc path makes before MarkWanted.
func (t *Tracker) Wanted() bool { return len(t.want) > 0 }

// WantedOn reports whether a mark is wanted on s (WantMark).
func (t *Tracker) WantedOn(s cuda.Stream) bool {
	for _, w := range t.want {
		if w == s {
			return true
		}
	}
	return false
}

// MarkWanted records the mark WantMark asked for on rs, the stream of the
// request at hand (the one stream known to exist now), if one was asked
// for, as Advance records one on it. Never during a capture.
func (t *Tracker) MarkWanted(c Clock, rs cuda.Stream, recordable func(cuda.Stream) bool, done func(*pools.Block)) {
	if t.unwant(rs) {
		t.mark(c, rs, recordable, done)
	}
}

// unwant takes s off the streams waiting for a mark, and reports whether it
// was there.
func (t *Tracker) unwant(s cuda.Stream) bool {
	for i, w := range t.want {
		if w == s {
			last := len(t.want) - 1
			t.want[i] = t.want[last]
			t.want = t.want[:last]
			return true
		}
	}
	return false
}

// Synchronized certifies every watched stream up to now: the caller has
// just synchronized the device, so every point below a new tick of c is
// behind every stream. Pending marks are dropped (they completed).
func (t *Tracker) Synchronized(c Clock) {
	at := c.Tick()
	for _, q := range t.queues {
		if q.watched {
			t.dropMarks(q)
			q.passed = at
		}
	}
	t.want = t.want[:0] // all certified: nothing to ask of any stream
	t.progress = true
}

// ResetProgress drops the pending marks, without waiting for them, and
// forgets what the completed ones certified: the caller is about to
// synchronize or has. Watched streams stay watched; the next Advance
// records new marks.
func (t *Tracker) ResetProgress() {
	t.progress = false
	for _, q := range t.queues {
		q.passed = 0
		t.dropMarks(q)
	}
	// The caller synchronizes: every free page is idle, and streams that
	// will never make a request again (destroyed ones) leave the list.
	t.want = t.want[:0]
}

// dropMarks takes q's pending marks out of its queue, their events back to
// the pool, and keeps the frees' events in order.
func (t *Tracker) dropMarks(q *queue) {
	if q.marks == 0 {
		return
	}
	kept := q.items[:q.head]
	for _, p := range q.items[q.head:] {
		if p.b == nil {
			t.spare = append(t.spare, p.ev)
			continue
		}
		kept = append(kept, p)
	}
	clear(q.items[len(kept):])
	q.items, q.marks = kept, 0
}

// Each calls fn for every block waiting on events or deferred.
func (t *Tracker) Each(fn func(*pools.Block)) {
	seen := map[*pools.Block]bool{}
	visit := func(b *pools.Block) {
		if !seen[b] {
			seen[b] = true
			fn(b)
		}
	}
	for _, q := range t.queues {
		for _, p := range q.items[q.head:] {
			if p.b != nil {
				visit(p.b)
			}
		}
	}
	for _, b := range t.deferred {
		visit(b)
	}
}

// DestroySpare destroys the pooled events that no block waits on, and the
// broken ones.
func (t *Tracker) DestroySpare() error {
	for len(t.broken) > 0 {
		if err := t.drv.EventDestroy(t.dev, t.broken[len(t.broken)-1]); err != nil {
			return err
		}
		t.broken = t.broken[:len(t.broken)-1]
		t.created--
	}
	for len(t.spare) > 0 {
		ev := t.spare[len(t.spare)-1]
		if err := t.drv.EventDestroy(t.dev, ev); err != nil {
			return err
		}
		t.spare = t.spare[:len(t.spare)-1]
		t.created--
	}
	return nil
}
