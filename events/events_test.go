// SPDX-License-Identifier: Apache-2.0

package events_test

import (
	"errors"
	"testing"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/events"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

func block(s cuda.Stream, uses ...cuda.Stream) *pools.Block {
	b := &pools.Block{Stream: s, Ptr: 0x1000}
	for _, u := range uses {
		events.RecordUse(b, u)
	}
	return b
}

func TestRecordUseIgnoresOwnStream(t *testing.T) {
	b := block(1, 1, 2, 2, 3)
	require.Equal(t, 2, b.Uses.Len())
	require.True(t, b.Uses.Has(2))
	require.False(t, b.Uses.Has(1))
}

func TestPerStreamQueuesInOrder(t *testing.T) {
	drv := sim.New(sim.Options{})
	tr := events.New(drv, 0)
	drv.Submit(2)
	a := block(1, 2)
	require.NoError(t, tr.Insert(a))
	b := block(1, 3) // stream 3 is idle: done at once
	require.NoError(t, tr.Insert(b))
	var done []*pools.Block
	collect := func(x *pools.Block) { done = append(done, x) }
	require.NoError(t, tr.Process(collect))
	require.Equal(t, []*pools.Block{b}, done, "a slow stream does not hold up another")
	require.False(t, tr.Idle())
	drv.Complete(2)
	require.NoError(t, tr.Process(collect))
	require.Equal(t, []*pools.Block{b, a}, done)
	require.True(t, tr.Idle())
	require.Equal(t, 2, tr.EventsCreated())
	require.NoError(t, tr.Insert(block(1, 2)))
	require.Equal(t, 2, tr.EventsCreated(), "events are pooled and reused")
	require.NoError(t, tr.Process(collect))
	require.NoError(t, tr.DestroySpare())
	require.Zero(t, drv.LiveEvents())
}

func TestBlockWaitsForAllStreams(t *testing.T) {
	drv := sim.New(sim.Options{})
	tr := events.New(drv, 0)
	drv.Submit(2)
	drv.Submit(3)
	b := block(1, 2, 3, 4, 5) // more uses than the inline set holds
	require.NoError(t, tr.Insert(b))
	require.Equal(t, 4, b.EventCount)
	n := 0
	count := func(*pools.Block) { n++ }
	drv.Complete(2)
	require.NoError(t, tr.Process(count))
	require.Zero(t, n)
	drv.Complete(3)
	require.NoError(t, tr.Process(count))
	require.Equal(t, 1, n)
	require.Zero(t, b.EventCount)
}

func TestDeferredUntilProcess(t *testing.T) {
	drv := sim.New(sim.Options{})
	tr := events.New(drv, 0)
	b := block(1, 2)
	tr.Defer(b)
	ev, def := tr.Pending()
	require.Equal(t, [2]int{0, 1}, [2]int{ev, def})
	require.Zero(t, drv.LiveEvents(), "nothing recorded while deferred")
	var done []*pools.Block
	require.NoError(t, tr.Process(func(x *pools.Block) { done = append(done, x) }))
	require.Equal(t, []*pools.Block{b}, done)
}

func TestSynchronizeWaitsForEverything(t *testing.T) {
	drv := sim.New(sim.Options{})
	tr := events.New(drv, 0)
	drv.Submit(2)
	require.NoError(t, tr.Insert(block(1, 2)))
	n := 0
	require.NoError(t, tr.Synchronize(func(*pools.Block) { n++ }))
	require.Equal(t, 1, n)
	require.True(t, tr.Idle())
}

// failingDriver makes EventRecord fail for one stream.
type failingDriver struct {
	*sim.Driver
	bad cuda.Stream
}

func (f failingDriver) EventRecord(dev int, e cuda.Event, s cuda.Stream) error {
	if s == f.bad {
		return cuda.ErrInvalidHandle
	}
	return f.Driver.EventRecord(dev, e, s)
}

func TestRecordFailureLosesNothing(t *testing.T) {
	drv := failingDriver{sim.New(sim.Options{}), 3}
	tr := events.New(drv, 0)
	b := block(1, 2, 3)
	err := tr.Insert(b)
	require.True(t, errors.Is(err, cuda.ErrInvalidHandle))
	require.True(t, b.Uses.Has(3), "the uncovered stream is kept")
	require.Equal(t, 1, b.EventCount)
	var done []*pools.Block
	require.NoError(t, tr.Process(func(x *pools.Block) { done = append(done, x) }))
	require.Empty(t, done, "never returned while a use is uncovered")
	_, def := tr.Pending()
	require.Equal(t, 1, def, "re-deferred for another try")
}

// clock is a Clock for the tests.
type clock struct{ now uint64 }

func (c *clock) Tick() uint64 { c.now++; return c.now }

// Stream progress: a mark recorded after a tick certifies the points below
// it once the stream has run past it; marks share the queues (and the event
// pool) with frees, in stream order. Marks are recorded on the stream of
// the request only.
func TestProgressMarks(t *testing.T) {
	drv := sim.New(sim.Options{})
	tr := events.New(drv, 0)
	var c clock
	all := func(cuda.Stream) bool { return true }
	var done []*pools.Block
	collect := func(b *pools.Block) { done = append(done, b) }

	tr.Advance(&c, 1, all, collect) // nothing watched: nothing recorded
	require.Zero(t, c.now)
	require.True(t, tr.Empty())
	tr.Watch(1)
	tr.Watch(1)
	require.True(t, tr.Watching())
	require.True(t, tr.Empty(), "watching alone records nothing: nothing to reset")
	require.False(t, tr.Passed(1, 0))

	// An idle stream: the mark completes at once and certifies its tick.
	tr.Advance(&c, 1, all, collect)
	require.Equal(t, uint64(1), c.now)
	require.True(t, tr.Passed(1, 0))
	require.False(t, tr.Empty(), "a watched stream has progress to reset")
	require.False(t, tr.Passed(1, 1))
	require.True(t, tr.Idle(), "marks are not frees")
	require.Equal(t, 1, tr.EventsCreated())

	// A busy stream: a free's event, then the mark, wait behind the work;
	// both complete together, in order.
	drv.Submit(1)
	b := block(2, 1)
	require.NoError(t, tr.Insert(b))
	tr.Advance(&c, 1, all, collect)
	require.Equal(t, uint64(2), c.now)
	require.False(t, tr.Passed(1, 1))
	require.Equal(t, 2, tr.EventsCreated())
	drv.Complete(1)
	tr.Advance(&c, 1, all, collect)
	require.Equal(t, []*pools.Block{b}, done, "Advance returns the frees it finds complete")
	require.True(t, tr.Idle())
	require.True(t, tr.Passed(1, 2), "the mark of tick 3 completed at once")
	require.Equal(t, uint64(3), c.now)
	require.Equal(t, 2, tr.EventsCreated(), "pooled events serve marks too")

	// At most MarkDepth marks wait on a stream; a stream recordable
	// refuses gets none.
	drv.Submit(1)
	for i := 0; i < events.MarkDepth+3; i++ {
		tr.Advance(&c, 1, all, collect)
	}
	require.Equal(t, uint64(3+events.MarkDepth), c.now)
	require.Equal(t, events.MarkDepth, tr.EventsCreated())
	tr.Watch(5)
	tr.Advance(&c, 5, func(s cuda.Stream) bool { return s != 5 }, collect)
	require.False(t, tr.Passed(5, 0))

	// Another stream's request marks that stream alone, watched or not:
	// a stream named earlier may have been destroyed since.
	drv.DestroyStream(1)
	tr.Advance(&c, 5, all, collect)
	require.True(t, tr.Passed(5, c.now-1), "stream 5 is idle")
	tr.Advance(&c, 6, all, collect)
	require.False(t, tr.Passed(6, 0), "stream 6 is not watched")
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())

	// Synchronize drops the marks without waiting for them, and certifies
	// nothing; ResetProgress forgets what was certified.
	require.NoError(t, tr.Synchronize(collect))
	require.False(t, tr.Passed(1, 3))
	require.True(t, tr.Passed(1, 2))
	drv.Complete(1)
	tr.ResetProgress()
	require.False(t, tr.Passed(1, 0))
	require.True(t, tr.Watched(1))
	require.NoError(t, tr.DestroySpare())
	require.Zero(t, drv.LiveEvents())
	require.Zero(t, tr.EventsCreated())
	require.True(t, tr.Empty(), "streams still watched, nothing held")
}

// ResetProgress drops pending marks from between frees' events, which
// still return their blocks.
func TestResetProgressKeepsFrees(t *testing.T) {
	drv := sim.New(sim.Options{})
	tr := events.New(drv, 0)
	var c clock
	tr.Watch(1)
	drv.Submit(1)
	a, b := block(2, 1), block(2, 1)
	require.NoError(t, tr.Insert(a))
	tr.Advance(&c, 1, func(cuda.Stream) bool { return true }, nil)
	require.NoError(t, tr.Insert(b))
	tr.ResetProgress()
	drv.Complete(1)
	var done []*pools.Block
	require.NoError(t, tr.Process(func(x *pools.Block) { done = append(done, x) }))
	require.Equal(t, []*pools.Block{a, b}, done)
	require.False(t, tr.Passed(1, 0))
	require.NoError(t, tr.DestroySpare())
	require.Zero(t, drv.LiveEvents())
}

// A stream asked for (WantMark) is marked at its next request, and only at
// its own: another stream's request names nothing, and a stream not
// watched is never asked for. At most maxWanted streams wait at once.
func TestWantedMarks(t *testing.T) {
	drv := sim.New(sim.Options{})
	tr := events.New(drv, 0)
	var c clock
	all := func(cuda.Stream) bool { return true }
	tr.WantMark(1)
	require.False(t, tr.Wanted(), "stream 1 is not watched")
	tr.Watch(1)
	tr.Watch(2)
	tr.WantMark(1)
	tr.WantMark(1)
	require.True(t, tr.Wanted())
	require.True(t, tr.WantedOn(1))
	require.False(t, tr.WantedOn(2))

	drv.DestroyStream(3)
	tr.MarkWanted(&c, 2, all, nil)
	tr.MarkWanted(&c, 3, all, nil)
	require.Zero(t, c.now, "no mark for streams nobody asked for")
	require.False(t, tr.Passed(1, 0))
	require.True(t, tr.Wanted())

	tr.MarkWanted(&c, 1, all, nil)
	require.Equal(t, uint64(1), c.now, "one mark, though asked for twice")
	require.True(t, tr.Passed(1, 0), "idle: the mark completed at once")
	require.False(t, tr.Wanted())
	tr.MarkWanted(&c, 1, all, nil)
	require.Equal(t, uint64(1), c.now, "asked for once, marked once")

	// A stream recordable refuses (capturing) is not marked, and is no
	// longer asked for: its next miss marks it as before.
	tr.WantMark(2)
	tr.MarkWanted(&c, 2, func(s cuda.Stream) bool { return s != 2 }, nil)
	require.False(t, tr.Passed(2, 0))
	require.False(t, tr.Wanted())

	for s := cuda.Stream(10); s < 30; s++ {
		tr.Watch(s)
		tr.WantMark(s)
	}
	n := 0
	for s := cuda.Stream(10); s < 30; s++ {
		before := c.now
		tr.MarkWanted(&c, s, all, nil)
		if c.now != before {
			n++
		}
	}
	require.Equal(t, 8, n, "the first eight asked for")
	require.False(t, tr.Wanted())

	// A miss of the stream (Advance) marks it: no second mark. A device
	// synchronization, or ResetProgress before one, certifies everything:
	// nothing stays asked for (a destroyed stream would never make the
	// request that takes it off the list).
	tr.WantMark(2)
	tr.Advance(&c, 2, all, nil)
	require.False(t, tr.WantedOn(2))
	tr.WantMark(1)
	tr.WantMark(2)
	tr.Synchronized(&c)
	require.False(t, tr.Wanted())
	tr.WantMark(1)
	tr.ResetProgress()
	require.False(t, tr.Wanted())
	require.NoError(t, tr.Synchronize(nil))
	require.NoError(t, tr.DestroySpare())
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}

// After a device synchronize every watched stream has run past every point
// before it: Synchronized certifies them all without naming any, and drops
// their pending marks (their events go back to the pool); frees' events
// stay for Process.
func TestSynchronizedCertifiesEveryStream(t *testing.T) {
	drv := sim.New(sim.Options{})
	tr := events.New(drv, 0)
	var c clock
	all := func(cuda.Stream) bool { return true }
	tr.Watch(1)
	tr.Watch(2)
	drv.Submit(1)
	b := block(3, 1)
	require.NoError(t, tr.Insert(b))
	tr.Advance(&c, 1, all, nil) // a mark behind stream 1's work
	require.False(t, tr.Passed(1, 0))
	drv.DestroyStream(2)

	require.NoError(t, drv.DeviceSynchronize(0))
	tr.Synchronized(&c)
	require.True(t, tr.Passed(1, c.now-1))
	require.True(t, tr.Passed(2, c.now-1), "a stream never marked, and destroyed since")
	require.False(t, tr.Passed(1, c.now))
	require.False(t, tr.Passed(7, 0), "not watched")
	var done []*pools.Block
	require.NoError(t, tr.Process(func(x *pools.Block) { done = append(done, x) }))
	require.Equal(t, []*pools.Block{b}, done)
	tr.Advance(&c, 1, all, nil) // drains stream 1's queue: no older mark takes the certification back
	require.True(t, tr.Passed(1, c.now-2))
	require.NoError(t, tr.DestroySpare())
	require.Zero(t, drv.LiveEvents(), "the dropped mark's event was pooled, then destroyed")
	require.Zero(t, drv.Violations(), "%v", drv.ViolationLog())
}
