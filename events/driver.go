// SPDX-License-Identifier: Apache-2.0

package events

import "github.com/cudapool/cudapool/cuda"

// Driver is what event-based deferral needs from CUDA. Every method names the
// device whose context the event belongs to.
type Driver interface {
	// EventCreate returns a new event with timing disabled.
	EventCreate(dev int) (cuda.Event, error)
	EventRecord(dev int, e cuda.Event, s cuda.Stream) error
	// EventQuery reports whether all work captured by the event's last record
	// has completed. Not-ready is (false, nil), not an error.
	EventQuery(dev int, e cuda.Event) (bool, error)
	EventSynchronize(dev int, e cuda.Event) error
	EventDestroy(dev int, e cuda.Event) error
}
