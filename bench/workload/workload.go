// SPDX-License-Identifier: Apache-2.0

// Package workload holds the allocation workloads that the Go benchmarks
// (the allocator package's and bench/gospeed) run, so that both measure the
// same sequences: Sequence, the Go twin of bench/workloads.h's mixed
// workload, replayed by Slots, and Mixed, the reference mix of 512 B to
// 144 MiB.
package workload

import (
	"math/rand"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
)

const (
	kiB = 1 << 10
	miB = 1 << 20
)

// SequenceLen is the length of Sequence (a power of two).
const SequenceLen = 65536

// Sequence is bench/workloads.h's mixed workload (sizes log-uniform in
// 512 B-144 MiB, 256 live slots, splitmix64 from the same seed), so that
// the Go figures match what the GPU benchmark measures through the C ABI.
func Sequence() (sizes []uint64, slots []int) {
	st := uint64(0x5EED0001)
	next := func() uint64 {
		st += 0x9E3779B97F4A7C15
		z := st
		z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
		z = (z ^ (z >> 27)) * 0x94D049BB133111EB
		return z ^ (z >> 31)
	}
	for i := 0; i < SequenceLen; i++ {
		e := 9 + next()%19
		lo := uint64(1) << e
		span := lo
		if e == 27 {
			span = 16 << 20
		}
		sizes = append(sizes, lo+next()%span)
		slots = append(slots, int(next()%256))
	}
	return sizes, slots
}

// Slots replays Sequence on an allocator's device 0, one pair per Step:
// the free of the slot's block, then the malloc of the next size into it.
type Slots struct {
	a     *allocator.Allocator
	sizes []uint64
	slots []int
	live  [256]cuda.Ptr
	i     int
}

// NewSlots returns a replay of Sequence on a, not yet started.
func NewSlots(a *allocator.Allocator) *Slots {
	s := &Slots{a: a}
	s.sizes, s.slots = Sequence()
	return s
}

// Step replays the next pair.
func (s *Slots) Step() {
	j := s.i & (SequenceLen - 1)
	if p := s.live[s.slots[j]]; p != 0 {
		_ = s.a.Free(allocator.FreeRequest{Ptr: p})
	}
	s.live[s.slots[j]], _ = s.a.Malloc(&allocator.MallocRequest{Size: s.sizes[j]})
	s.i++
}

// Mixed keeps n live blocks of sizes from 512 B to 144 MiB (the reference
// mix: 70% up to 64 KiB, 25% up to 8 MiB, the rest up to 144 MiB) and
// replaces one per step.
type Mixed struct {
	a     *allocator.Allocator
	live  []cuda.Ptr
	sizes []uint64
	i     int
}

// NewMixed returns the mix of n live blocks on a's device 0, none
// allocated yet.
func NewMixed(a *allocator.Allocator, n int) *Mixed {
	rng := rand.New(rand.NewSource(1))
	m := &Mixed{a: a, live: make([]cuda.Ptr, n)}
	for i := 0; i < 4096; i++ {
		var s uint64
		switch r := rng.Intn(100); {
		case r < 70:
			s = uint64(rng.Intn(64*kiB) + 512)
		case r < 95:
			s = uint64(rng.Intn(8*miB) + 1)
		default:
			s = uint64(rng.Intn(144*miB) + 1)
		}
		m.sizes = append(m.sizes, s)
	}
	return m
}

// Run takes n steps: each frees the oldest live block and allocates the
// next size in its place.
func (m *Mixed) Run(n int) {
	for k := 0; k < n; k++ {
		slot := m.i % len(m.live)
		if p := m.live[slot]; p != 0 {
			_ = m.a.Free(allocator.FreeRequest{Ptr: p})
		}
		m.live[slot], _ = m.a.Malloc(&allocator.MallocRequest{Size: m.sizes[m.i%len(m.sizes)]})
		m.i++
	}
}
