// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"fmt"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/bench/workload"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

// Driver calls in the steady state of bench/workloads.h's mixed workload:
// 256 live blocks of 512 B to 144 MiB, one freed and one allocated per
// pair, after the initial fill and one warm-up cycle of the sequence (the
// C benchmark's timed reps start there). On the GPU each call that maps,
// unmaps, creates, releases or sets access costs tens of microseconds, more
// than a cached pair; a working set that stays the same makes none.

// vmmCalls counts the driver calls that make or give back memory: those of
// expandable segments, those of ordinary segments (allocs, frees), and
// stitching's page moves (each one unmap and one map).
type vmmCalls struct {
	creates, releases, maps, unmaps, access, allocs, frees int
	remaps                                                 int64
}

var vmmCallNames = []string{"creates", "releases", "maps", "unmaps", "set-access", "allocs", "frees", "page-moves"}

func (c vmmCalls) values() []float64 {
	return []float64{float64(c.creates), float64(c.releases), float64(c.maps), float64(c.unmaps), float64(c.access),
		float64(c.allocs), float64(c.frees), float64(c.remaps)}
}

func (c vmmCalls) sub(o vmmCalls) vmmCalls {
	return vmmCalls{c.creates - o.creates, c.releases - o.releases, c.maps - o.maps, c.unmaps - o.unmaps,
		c.access - o.access, c.allocs - o.allocs, c.frees - o.frees, c.remaps - o.remaps}
}

func readVMMCalls(t testing.TB, f *fault.Driver, a *allocator.Allocator) vmmCalls {
	st, err := a.StitchStats(0)
	require.NoError(t, err)
	return vmmCalls{
		creates:  f.Calls("MemCreate") + f.Calls("MemCreateShareable"),
		releases: f.Calls("MemRelease"),
		maps:     f.Calls("MemMap"),
		unmaps:   f.Calls("MemUnmap"),
		access:   f.Calls("MemSetAccess"),
		allocs:   f.Calls("MemAlloc"),
		frees:    f.Calls("MemFree"),
		remaps:   st.Remaps,
	}
}

// steadyMixed is the workload on an 80 GiB simulated device (an H100's),
// its driver wrapped to count calls, after the fill and the warm-up cycle.
type steadyMixed struct {
	a      *allocator.Allocator
	f      *fault.Driver
	sizes  []uint64
	slots  []int
	live   [256]cuda.Ptr
	k      int
	failed int
	warm   vmmCalls
}

func newSteadyMixed(t testing.TB, conf string) *steadyMixed {
	cfg, _, err := allocator.ParseConfig(conf)
	require.NoError(t, err)
	m := &steadyMixed{f: fault.New(sim.New(sim.Options{Devices: 1, Memory: 80 * GiB}))}
	m.a, err = allocator.New(m.f, cfg)
	require.NoError(t, err)
	m.a.ExpectAnnouncements() // as PyTorch: no capture-status query per malloc
	m.sizes, m.slots = workload.Sequence()
	for s := range m.live {
		m.live[s] = mustMalloc(t, m.a, 0, m.sizes[s], 0)
	}
	m.run(len(m.sizes))
	require.Zero(t, m.failed, "%s: warm-up mallocs failed", conf)
	m.warm = readVMMCalls(t, m.f, m.a)
	return m
}

// run replays n pairs, as bench/workloads.h's wl_mixed_run does.
func (m *steadyMixed) run(n int) {
	for ; n > 0; n-- {
		j := m.k & (len(m.sizes) - 1)
		m.k++
		s := m.slots[j]
		if err := m.a.Free(allocator.FreeRequest{Ptr: m.live[s]}); err != nil {
			m.failed++
		}
		p, err := m.a.Malloc(&allocator.MallocRequest{Size: m.sizes[j]})
		if err != nil || p == 0 {
			m.failed++
		}
		m.live[s] = p
	}
}

var steadyConfs = []string{"", ordinary, "expandable_segments:True,stitch:False"}

func confName(conf string) string {
	if conf == "" {
		return "defaults"
	}
	return conf
}

// Every configuration, the default (expandable segments with stitching)
// included, makes no driver call in the steady state, in the first window
// of pairs as in each later one (a working set that reached its slack late
// would still create or move pages there); and the default, to get there,
// holds no more memory than ordinary segments.
func TestMixedSteadyStateMakesNoDriverCalls(t *testing.T) {
	const (
		pairs   = 50000 // one rep of the C benchmark's --mixed-pairs 50000
		windows = 6     // ordinary segments allocate once more near 375,000 pairs
	)
	reserved := map[string]int64{}
	for _, conf := range steadyConfs {
		m := newSteadyMixed(t, conf)
		require.Positive(t, m.warm.allocs+m.warm.creates, "the fill and the warm-up made memory: the counters count")
		before := m.warm
		for w := 1; w <= windows; w++ {
			m.run(pairs)
			require.Zero(t, m.failed)
			now := readVMMCalls(t, m.f, m.a)
			calls := now.sub(before)
			before = now
			line := ""
			for i, v := range calls.values() {
				line += fmt.Sprintf(" %s %.2f", vmmCallNames[i], v*1000/pairs)
			}
			st := stats(t, m.a, 0)
			reserved[conf] = st.ReservedBytes[pools.StatAll].Peak
			t.Logf("%s, pairs %d-%d: per 1,000 pairs:%s; reserved %d MiB (peak %d MiB, peak allocated %d MiB)", confName(conf),
				(w-1)*pairs, w*pairs, line, st.ReservedBytes[pools.StatAll].Current>>20, reserved[conf]>>20, st.AllocatedBytes[pools.StatAll].Peak>>20)
			require.Equal(t, vmmCalls{}, calls, "%s: driver calls in the steady state, pairs %d-%d", confName(conf), (w-1)*pairs, w*pairs)
		}
		require.NoError(t, m.a.CheckInvariants())
	}
	require.LessOrEqual(t, reserved[""], reserved[ordinary],
		"the default's steady state costs no more memory than ordinary segments")
}

// BenchmarkMixedSteadyCalls reports the driver calls per 1,000 steady
// pairs of each configuration (and the host time per pair on the
// simulator, which leaves the GPU's cost of those calls out).
func BenchmarkMixedSteadyCalls(b *testing.B) {
	for _, conf := range steadyConfs {
		b.Run(confName(conf), func(b *testing.B) {
			m := newSteadyMixed(b, conf)
			before := readVMMCalls(b, m.f, m.a)
			n := 0
			for b.Loop() {
				m.run(1)
				n++
			}
			if m.failed > 0 {
				b.Fatalf("%d mallocs failed", m.failed)
			}
			calls := readVMMCalls(b, m.f, m.a).sub(before)
			for i, v := range calls.values() {
				b.ReportMetric(v*1000/float64(n), vmmCallNames[i]+"/1k-pairs")
			}
		})
	}
}
