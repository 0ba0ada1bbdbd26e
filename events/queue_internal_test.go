// SPDX-License-Identifier: Apache-2.0

package events

import (
	"testing"

	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
)

// A stream that always has one event outstanding never empties its queue;
// compaction must keep the queue from growing with every free ever made.
func TestQueueStaysBounded(t *testing.T) {
	drv := sim.New(sim.Options{})
	tr := New(drv, 0)
	done := func(*pools.Block) {}
	for i := 0; i < 100000; i++ {
		drv.Complete(2)
		drv.Submit(2)
		b := &pools.Block{Stream: 1, Ptr: 0x1000}
		RecordUse(b, 2)
		if err := tr.Insert(b); err != nil {
			t.Fatal(err)
		}
		if err := tr.Process(done); err != nil {
			t.Fatal(err)
		}
	}
	q := tr.queues[2]
	t.Logf("pending=%d live items=%d len(items)=%d cap=%d", tr.pending, len(q.items)-q.head, len(q.items), cap(q.items))
	if cap(q.items) > 1024 {
		t.Fatalf("queue for stream 2 holds %d slots for %d pending events", cap(q.items), tr.pending)
	}
}
