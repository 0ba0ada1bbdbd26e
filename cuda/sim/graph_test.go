// SPDX-License-Identifier: Apache-2.0

package sim_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
)

// ancestors returns every node n's terminals depend on, terminals included.
func ancestors(t *testing.T, d *sim.Driver, terms []cuda.GraphNode) map[cuda.GraphNode]bool {
	t.Helper()
	seen := map[cuda.GraphNode]bool{}
	stack := append([]cuda.GraphNode(nil), terms...)
	for len(stack) > 0 {
		n := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if seen[n] {
			continue
		}
		seen[n] = true
		deps, err := d.GraphNodeDependencies(0, n, nil)
		require.NoError(t, err)
		stack = append(stack, deps...)
	}
	return seen
}

func terminals(t *testing.T, d *sim.Driver, s cuda.Stream) []cuda.GraphNode {
	t.Helper()
	st, _, terms, err := d.StreamCaptureGraph(0, s, nil)
	require.NoError(t, err)
	require.Equal(t, cuda.CaptureActive, st)
	return terms
}

// A fork (a stream waits on an event of a capturing stream) joins the
// capture; its work is not an ancestor of the origin's until a join.
func TestCaptureGraphForkJoin(t *testing.T) {
	d := sim.New(sim.Options{})
	th := newThread(t)
	const s1, s2 = cuda.Stream(1), cuda.Stream(2)
	ev, err := d.EventCreate(0)
	require.NoError(t, err)
	th.do(func() { require.NoError(t, d.BeginCapture(s1, cuda.CaptureModeThreadLocal)) })
	assert.Empty(t, terminals(t, d, s1), "no work captured yet")
	d.Submit(s1)
	first := terminals(t, d, s1)
	require.Len(t, first, 1)

	require.NoError(t, d.EventRecord(0, ev, s1))
	require.NoError(t, d.StreamWaitEvent(0, s2, ev)) // fork
	st, id1, err := d.StreamCaptureInfo(0, s2)
	require.NoError(t, err)
	_, id0, _ := d.StreamCaptureInfo(0, s1)
	assert.Equal(t, cuda.CaptureActive, st, "s2 joined the capture")
	assert.Equal(t, id0, id1)
	assert.Equal(t, first, terminals(t, d, s2), "a fork starts from the event's nodes")

	d.Submit(s2)
	work2 := terminals(t, d, s2)
	d.Submit(s1)
	assert.False(t, ancestors(t, d, terminals(t, d, s1))[work2[0]], "s2's work is not before s1's until joined")

	th.do(func() {
		assert.ErrorIs(t, d.EndCapture(s2), cuda.ErrCaptureUnmatched, "only the origin stream ends a capture")
	})

	require.NoError(t, d.EventRecord(0, ev, s2))
	require.NoError(t, d.StreamWaitEvent(0, s1, ev)) // join
	assert.Len(t, terminals(t, d, s1), 2, "a join adds the event's nodes to the stream's terminals")
	d.Submit(s1)
	assert.True(t, ancestors(t, d, terminals(t, d, s1))[work2[0]], "after the join s2's work comes before s1's")

	th.do(func() { require.NoError(t, d.EndCapture(s1)) })
	st, _, err = d.StreamCaptureInfo(0, s2)
	require.NoError(t, err)
	assert.Equal(t, cuda.CaptureNone, st, "ending the capture ends it for joined streams")
	_, err = d.GraphNodeDependencies(0, work2[0], nil)
	assert.ErrorIs(t, err, cuda.ErrInvalidValue, "nodes of an ended capture are gone")
}

func TestCaptureGraphUnjoinedAndIsolation(t *testing.T) {
	d := sim.New(sim.Options{})
	th := newThread(t)
	const s1, s2, s3 = cuda.Stream(1), cuda.Stream(2), cuda.Stream(3)
	ev, err := d.EventCreate(0)
	require.NoError(t, err)
	outside, err := d.EventCreate(0)
	require.NoError(t, err)
	require.NoError(t, d.EventRecord(0, outside, s3))
	th.do(func() { require.NoError(t, d.BeginCapture(s1, cuda.CaptureModeThreadLocal)) })
	require.NoError(t, d.EventRecord(0, ev, s1))
	require.NoError(t, d.StreamWaitEvent(0, s2, ev))
	d.Submit(s2) // never joined back
	th.do(func() { assert.ErrorIs(t, d.EndCapture(s1), cuda.ErrCaptureUnjoined) })
	assert.Zero(t, d.ActiveCaptures(), "an unjoined capture still ends")

	th.do(func() { require.NoError(t, d.BeginCapture(s1, cuda.CaptureModeThreadLocal)) })
	assert.ErrorIs(t, d.StreamWaitEvent(0, s1, outside), cuda.ErrCaptureIsolation, "a capture may not wait on outside work")
	th.do(func() { assert.ErrorIs(t, d.EndCapture(s1), cuda.ErrCaptureInvalidated) })
	assert.NoError(t, d.StreamWaitEvent(0, s2, outside), "waits outside capture are accepted")
}

// Use on a capturing stream, its origin or one that joined it by a fork,
// is captured work like Submit: a node after the stream's terminals, and
// nothing enqueued (a Use on a joined stream was enqueued as eager work,
// and left the graph without the kernel).
func TestCaptureGraphUseIsANode(t *testing.T) {
	d := sim.New(sim.Options{})
	th := newThread(t)
	const s1, s2 = cuda.Stream(1), cuda.Stream(2)
	ev, err := d.EventCreate(0)
	require.NoError(t, err)
	th.do(func() { require.NoError(t, d.BeginCapture(s1, cuda.CaptureModeThreadLocal)) })
	d.Submit(s1)
	require.NoError(t, d.EventRecord(0, ev, s1))
	require.NoError(t, d.StreamWaitEvent(0, s2, ev)) // fork
	for _, s := range []cuda.Stream{s1, s2} {
		before := terminals(t, d, s)
		d.Use(0, s, 1<<44, 4096)
		after := terminals(t, d, s)
		require.Len(t, after, 1)
		assert.NotContains(t, before, after[0], "stream %d: the Use is a new node", s)
		assert.True(t, ancestors(t, d, after)[before[0]], "stream %d: after the stream's earlier work", s)
	}
	require.NoError(t, d.EventRecord(0, ev, s2))
	require.NoError(t, d.StreamWaitEvent(0, s1, ev)) // join
	th.do(func() { require.NoError(t, d.EndCapture(s1)) })
	require.NoError(t, d.EventRecord(0, ev, s2))
	done, err := d.EventQuery(0, ev)
	require.NoError(t, err)
	assert.True(t, done, "nothing was enqueued on s2 during the capture")
}
