// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"encoding/binary"
	"errors"
	"math/rand"
	"sort"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

// machine interprets a byte string as a sequence of allocator operations on
// two devices, several streams and one capture at a time, and checks every
// invariant after each step. The randomized test feeds it random bytes; the
// fuzz target feeds it the fuzzer's.
type machine struct {
	t       testing.TB
	a       *allocator.Allocator
	drv     *sim.Driver
	live    map[cuda.Ptr]liveAlloc
	ptrs    []cuda.Ptr // live pointers, for picking one
	pools   []allocator.PoolID
	held    map[allocator.PoolID]int // holders not yet released
	capture *runningCapture
	nextID  uint64
	data    []byte
	// placed is every malloc's result in order (0: out of memory), so that
	// runs of one input through different free sets can be compared.
	placed []cuda.Ptr
}

type liveAlloc struct {
	dev    int
	size   uint64
	stream cuda.Stream
}

type runningCapture struct {
	dev    int
	pool   allocator.PoolID
	stream cuda.Stream
}

const (
	devices      = 2
	streams      = 3
	captureBase  = cuda.Stream(50)
	machineBytes = 256 * MiB
)

func newMachine(t testing.TB, conf string, data []byte) *machine {
	cfg, _, err := allocator.ParseConfig(conf)
	require.NoError(t, err)
	drv := sim.New(sim.Options{Devices: devices, Memory: machineBytes})
	a, err := allocator.New(drv, cfg)
	require.NoError(t, err)
	return &machine{t: t, a: a, drv: drv, live: map[cuda.Ptr]liveAlloc{}, held: map[allocator.PoolID]int{}, data: data}
}

func (m *machine) byte() int {
	if len(m.data) == 0 {
		return 0
	}
	b := m.data[0]
	m.data = m.data[1:]
	return int(b)
}

func (m *machine) size() uint64 {
	// Mostly small, sometimes large, now and then huge.
	var raw [4]byte
	for i := range raw {
		raw[i] = byte(m.byte())
	}
	n := uint64(binary.LittleEndian.Uint32(raw[:]))
	switch n % 8 {
	case 0, 1, 2, 3:
		return n%(1*MiB) + 1
	case 4, 5, 6:
		return n%(24*MiB) + 1
	default:
		return n%(120*MiB) + 1
	}
}

func (m *machine) run() {
	for len(m.data) > 0 {
		m.step()
		require.NoError(m.t, m.a.CheckInvariants())
		m.checkNoOverlap()
		m.checkMemory()
		require.Zero(m.t, m.drv.Violations(), "%v", m.drv.ViolationLog())
	}
	m.drain()
}

// checkMemory checks the allocator against the driver: every live
// allocation is memory the device can reach (mapped and accessible, in
// expandable segments), and the memory the driver has handed out is what
// the allocator counts as reserved.
func (m *machine) checkMemory() {
	for p, la := range m.live {
		require.True(m.t, m.drv.Accessible(la.dev, p, la.size), "allocation %#x+%d is not accessible memory", p, la.size)
	}
	for dev := 0; dev < devices; dev++ {
		st, err := m.a.Stats(dev)
		require.NoError(m.t, err)
		require.Equal(m.t, uint64(st.ReservedBytes[pools.StatAll].Current), m.drv.Used(dev), "device %d: reserved bytes vs driver memory", dev)
	}
}

func (m *machine) malloc(dev int, s cuda.Stream) {
	size := m.size()
	p, err := m.a.Malloc(&allocator.MallocRequest{Dev: dev, Size: size, Stream: s})
	m.placed = append(m.placed, p)
	if err != nil {
		require.ErrorIs(m.t, err, allocator.ErrOutOfMemory)
		return
	}
	require.NotZero(m.t, p)
	_, dup := m.live[p]
	require.False(m.t, dup, "pointer %#x handed out twice", p)
	m.live[p] = liveAlloc{dev, size, s}
	m.ptrs = append(m.ptrs, p)
	// A kernel writes the block on its stream: the simulator refuses to
	// unmap the memory until that work completes.
	m.drv.Use(dev, s, p, size)
}

func (m *machine) pick() (cuda.Ptr, liveAlloc, int) {
	i := m.byte() % len(m.ptrs)
	p := m.ptrs[i]
	return p, m.live[p], i
}

func (m *machine) free(p cuda.Ptr, i int) {
	la := m.live[p]
	require.NoError(m.t, m.a.Free(allocator.FreeRequest{Dev: la.dev, Ptr: p, Size: la.size}))
	delete(m.live, p)
	m.ptrs[i] = m.ptrs[len(m.ptrs)-1]
	m.ptrs = m.ptrs[:len(m.ptrs)-1]
}

func (m *machine) step() {
	op := m.byte() % 16
	dev := m.byte() % devices
	s := cuda.Stream(m.byte() % streams)
	switch {
	case op < 5:
		m.malloc(dev, s)
	case op < 9:
		if len(m.ptrs) > 0 {
			p, _, i := m.pick()
			m.free(p, i)
		}
	case op == 9:
		if len(m.ptrs) > 0 {
			p, _, _ := m.pick()
			require.NoError(m.t, m.a.RecordStream(p, s))
			m.drv.Submit(s)
		}
	case op == 10:
		if m.byte()%2 == 0 {
			m.drv.Complete(s)
		} else {
			m.drv.CompleteAll()
		}
	case op == 11:
		err := m.a.EmptyCache(0)
		if m.capture != nil {
			require.ErrorIs(m.t, err, allocator.ErrCaptureUnderway)
		} else {
			require.NoError(m.t, err)
		}
	case op == 12:
		if m.capture == nil {
			m.beginCapture(dev)
		} else {
			m.endCapture()
		}
	case op == 13:
		if m.capture != nil {
			m.malloc(m.capture.dev, m.capture.stream)
		}
	case op == 14:
		m.releaseSome()
	case op == 15:
		if m.byte()%8 == 0 {
			f := float64(m.byte()%5+6) / 10
			require.NoError(m.t, m.a.SetMemoryFraction(dev, f))
		}
	}
}

func (m *machine) beginCapture(dev int) {
	var pool allocator.PoolID
	// Share a held pool now and then, as graphs given pool=other.pool() do.
	if k := m.byte(); len(m.pools) > 0 && k%3 == 0 {
		pool = m.pools[k%len(m.pools)]
		if m.held[pool] == 0 || pool.A%devices != uint64(dev) {
			pool = allocator.PoolID{}
		}
	}
	if pool == (allocator.PoolID{}) {
		m.nextID++
		pool = allocator.PoolID{A: m.nextID*devices + uint64(dev)} // device-specific ids
		m.pools = append(m.pools, pool)
	}
	s := captureBase + cuda.Stream(dev)
	require.NoError(m.t, m.a.BeginAllocateToPool(dev, pool, func(x cuda.Stream) bool { return x == s }))
	mode := cuda.CaptureMode(m.byte() % 3)
	require.NoError(m.t, m.drv.BeginCapture(s, mode))
	m.held[pool]++
	m.capture = &runningCapture{dev, pool, s}
}

func (m *machine) endCapture() {
	c := m.capture
	require.NoError(m.t, m.drv.EndCapture(c.stream))
	require.NoError(m.t, m.a.EndAllocateToPool(c.dev, c.pool))
	m.capture = nil
}

func (m *machine) releaseSome() {
	for _, p := range m.pools {
		if m.held[p] > 0 && (m.capture == nil || m.capture.pool != p) {
			require.NoError(m.t, m.a.ReleasePool(int(p.A%devices), p))
			m.held[p]--
			return
		}
	}
}

func (m *machine) checkNoOverlap() {
	type iv struct{ lo, hi cuda.Ptr }
	var per [devices][]iv
	for p, la := range m.live {
		per[la.dev] = append(per[la.dev], iv{p, p + cuda.Ptr(la.size)})
	}
	for _, ivs := range per {
		sort.Slice(ivs, func(i, j int) bool { return ivs[i].lo < ivs[j].lo })
		for i := 1; i < len(ivs); i++ {
			require.LessOrEqual(m.t, ivs[i-1].hi, ivs[i].lo, "live allocations overlap")
		}
	}
}

// drain frees everything and checks that nothing was lost.
func (m *machine) drain() {
	if m.capture != nil {
		m.endCapture()
	}
	for len(m.ptrs) > 0 {
		m.free(m.ptrs[0], 0)
	}
	for p, n := range m.held {
		for ; n > 0; n-- {
			require.NoError(m.t, m.a.ReleasePool(int(p.A%devices), p))
		}
	}
	m.drv.CompleteAll()
	require.NoError(m.t, m.a.EmptyCache(0))
	require.NoError(m.t, m.a.CheckInvariants())
	for dev := 0; dev < devices; dev++ {
		require.Equal(m.t, 0, m.drv.Live(dev), "device %d: segments left after freeing everything", dev)
		require.Zero(m.t, m.drv.Handles(dev), "device %d: physical allocations left", dev)
		n, _ := m.drv.Reservations(dev)
		require.Zero(m.t, n, "device %d: address ranges left", dev)
		st, err := m.a.Stats(dev)
		require.NoError(m.t, err)
		for _, arr := range []pools.StatArray{st.Allocation, st.Segment, st.Active, st.ReservedBytes, st.AllocatedBytes, st.RequestedBytes, st.InactiveSplit} {
			for k := range arr {
				require.Zero(m.t, arr[k].Current)
			}
		}
	}
	require.Zero(m.t, m.drv.LiveEvents(), "events leaked")
	require.Zero(m.t, m.drv.Violations(), "%v", m.drv.ViolationLog())
}

// runEveryFreeSet runs the machine on data once per free-set implementation
// and requires the same placements from each: they must be the same best
// fit, decision for decision, not merely keep the invariants.
func runEveryFreeSet(t *testing.T, conf string, data []byte) {
	runFreeSets(t, conf, data, pools.FreeSetKinds)
}

func runFreeSets(t *testing.T, conf string, data []byte, kinds []pools.FreeSetKind) *machine {
	var first []cuda.Ptr
	var m0 *machine
	for i, k := range kinds {
		c := "free_set:" + k.String()
		if conf != "" {
			c = conf + "," + c
		}
		m := newMachine(t, c, append([]byte(nil), data...))
		m.run()
		if i == 0 {
			first, m0 = m.placed, m
		} else {
			require.Equal(t, first, m.placed, "free_set:%s placed blocks differently from free_set:%s", k, kinds[0])
		}
	}
	return m0
}

func TestRandomizedInvariants(t *testing.T) {
	const ord, exp = "expandable_segments:False", "expandable_segments:True,stitch:False"
	confs := []string{ord, ord + ",max_split_size_mb:32", ord + ",roundup_power2_divisions:4",
		ord + ",garbage_collection_threshold:0.7", ord + ",max_split_size_mb:20,max_non_split_rounding_mb:4",
		exp, exp + ",max_split_size_mb:32", exp + ",garbage_collection_threshold:0.7,roundup_power2_divisions:4",
		// Stitching (the default, named), alone and with other keys.
		stitching, stitching + ",max_split_size_mb:32", "stitch:True,expandable_map_unit_mb:2,max_split_size_mb:32",
		"stitch:True,garbage_collection_threshold:0.7", "stitch_chunk_mb:4", "stitch_chunk_mb:6,max_split_size_mb:32"}
	seeds := 12
	if testing.Short() || raceOn {
		seeds = 3
	}
	for _, conf := range confs {
		var moved, lent int64 // stitching's remaps, over the seeds
		for seed := 0; seed < seeds; seed++ {
			rng := rand.New(rand.NewSource(int64(seed)))
			data := make([]byte, 6000)
			rng.Read(data)
			// Every seed compares the two fast sets; the first three also
			// the sorted slice, the slow reference.
			kinds := []pools.FreeSetKind{pools.FreeSetSegFit, pools.FreeSetTreap}
			if seed < 3 {
				kinds = pools.FreeSetKinds
			}
			t.Run(conf+"/"+string(rune('a'+seed)), func(t *testing.T) {
				lockThread(t)
				m := runFreeSets(t, conf, data, kinds)
				for dev := 0; dev < devices; dev++ {
					st, err := m.a.StitchStats(dev)
					require.NoError(t, err)
					moved += st.Remaps - st.Lent
					lent += st.Lent
				}
			})
		}
		if cfg, _, err := allocator.ParseConfig(conf); err == nil && cfg.Stitch {
			// The runs did exercise both ways of moving pages.
			require.Positive(t, moved, "%s: pages unmapped and moved", conf)
			require.Positive(t, lent, "%s: pages lent", conf)
		}
	}
}

func FuzzAllocator(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 2, 3, 4, 5, 6, 0, 0, 7, 1, 1, 1})
	f.Add([]byte{12, 0, 0, 0, 13, 0, 0, 1, 2, 3, 4, 6, 0, 0, 0, 12, 11, 14, 11})
	rng := rand.New(rand.NewSource(99))
	seed := make([]byte, 400)
	rng.Read(seed)
	f.Add(seed)
	f.Fuzz(func(t *testing.T, data []byte) {
		lockThread(t)
		// The first byte picks ordinary segments or expandable ones,
		// without or with stitching (the default: 20 MiB at a time, or
		// page by page); every free set runs the input.
		conf := ""
		if len(data) > 0 {
			conf = [...]string{ordinary, "expandable_segments:True,stitch:False", "", "stitch:True,expandable_map_unit_mb:2"}[data[0]%4]
		}
		runEveryFreeSet(t, conf, data)
	})
}

// The debug switch runs the invariant checks inside the allocator.
func TestDebugChecksSwitch(t *testing.T) {
	a, _ := newAlloc(t, 1, GiB, "debug_checks:True")
	require.True(t, a.Config().DebugChecks)
	p := mustMalloc(t, a, 0, 4096, 0)
	require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
	require.True(t, errors.Is(a.Free(allocator.FreeRequest{Ptr: p}), allocator.ErrAlreadyFreed))
}
