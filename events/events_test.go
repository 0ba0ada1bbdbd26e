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
