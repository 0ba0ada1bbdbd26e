// SPDX-License-Identifier: Apache-2.0

package vmem_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
	"github.com/cudapool/cudapool/pools"
	"github.com/cudapool/cudapool/vmem"
)

const MiB = 1 << 20

// progress is a Progress that knows nothing of the streams but whether
// they are watched, and records its calls.
type progress struct {
	watched  map[cuda.Stream]bool
	advanced []cuda.Stream // Advance's streams, in order
	wanted   []cuda.Stream // WantMark's streams, in order
	resets   int
}

func (p *progress) Watch(s cuda.Stream)                  { p.watched[s] = true }
func (p *progress) Watched(s cuda.Stream) bool           { return p.watched[s] }
func (p *progress) Watching() bool                       { return len(p.watched) > 0 }
func (p *progress) Passed(cuda.Stream, uint64) bool      { return false }
func (p *progress) Advance(rs cuda.Stream)               { p.advanced = append(p.advanced, rs) }
func (p *progress) Reset()                               { p.resets++ }
func (p *progress) WantMark(s cuda.Stream)               { p.wanted = append(p.wanted, s) }
func (p *progress) Synchronized()                        {}
func (p *progress) String() string                       { return fmt.Sprint(p.watched) }
func newProgress() *progress                             { return &progress{watched: map[cuda.Stream]bool{}} }
func (r *recorder) Mapped(_ *pools.Segment, _, n uint64) { r.mapped += n }
func (r *recorder) Unmapped(_ *pools.Segment, _, n uint64, lent bool) {
	if lent {
		r.lent += n
	} else {
		r.unmapped += n
	}
}

// recorder sums the bytes it is told of.
type recorder struct{ mapped, unmapped, lent uint64 }

// env is a Space over the simulator (through the fault driver) and a cache.
type env struct {
	s        *vmem.Space
	c        *pools.Cache
	f        *fault.Driver
	rec      *recorder
	prog     *progress
	warnings []string
}

func newEnv(t *testing.T, cfg vmem.Config, withDriver bool) *env {
	t.Helper()
	return newEnvMemory(t, cfg, withDriver, 1<<30)
}

// newEnvMemory is newEnv on a device of memory bytes.
func newEnvMemory(t *testing.T, cfg vmem.Config, withDriver bool, memory uint64) *env {
	t.Helper()
	e := &env{c: pools.NewCache(pools.DefaultConfig()), f: fault.New(sim.New(sim.Options{Memory: memory})), rec: &recorder{}, prog: newProgress()}
	var drv vmem.Driver
	if withDriver {
		drv = e.f
	}
	e.s = vmem.New(vmem.Deps{
		Driver: drv, Cache: e.c, Progress: e.prog, Recorder: e.rec,
		Capacity: func() (uint64, error) { return memory, nil },
		Fail:     func(op, what string, err error) error { return fmt.Errorf("%s: %s: %w", op, what, err) },
		Warn:     func(m string) { e.warnings = append(e.warnings, m) },
	}, cfg)
	if withDriver && (cfg.Expandable || cfg.Stitch) {
		require.True(t, e.s.Expandable()) // the owner probes first
	}
	return e
}

// malloc grows the cache through the Space and allocates size bytes on s.
func (e *env) malloc(t *testing.T, size uint64, s cuda.Stream, capturing bool) (*pools.Block, error) {
	t.Helper()
	var r pools.Request
	e.c.SetRequest(&r, size, s, e.c.Small, e.c.Large)
	b, err := e.s.Grow(r, capturing)
	if b == nil || err != nil {
		return nil, err
	}
	return e.c.Allocate(&r, b), nil
}

func (e *env) free(b *pools.Block) {
	e.c.Release(b)
	e.c.Return(b)
}

// Without the driver's VMM API growth falls back to ordinary segments:
// with a note where the configuration named expandable memory, quietly
// where it is on by default; a later configuration that names it gets the
// note then.
func TestNoVirtualMemoryFallsBack(t *testing.T) {
	e := newEnv(t, vmem.Config{Expandable: true, Named: "expandable_segments:True"}, false)
	require.False(t, e.s.Expandable())
	require.False(t, e.s.Expandable())
	require.Len(t, e.warnings, 1, "warned once")
	require.Contains(t, e.warnings[0], "no virtual memory management API")
	require.True(t, strings.HasPrefix(e.warnings[0], "expandable_segments:True: "), e.warnings[0])

	e = newEnv(t, vmem.Config{Expandable: true, Stitch: true}, false)
	require.False(t, e.s.Expandable())
	require.Empty(t, e.warnings, "the default falls back quietly")
	e.s.Configure(vmem.Config{Expandable: true, Stitch: true, Named: "stitch:True"})
	require.False(t, e.s.Expandable())
	require.Len(t, e.warnings, 1, "named later: the note comes then")
	require.True(t, strings.HasPrefix(e.warnings[0], "stitch:True: the CUDA driver has no virtual memory management API; using ordinary segments"), e.warnings[0])
	e.s.Configure(vmem.Config{})
	require.Len(t, e.warnings, 1, "turned off: nothing more to say")

	require.False(t, newEnv(t, vmem.Config{}, true).s.Expandable(), "not asked for")
	require.True(t, newEnv(t, vmem.Config{Stitch: true}, true).s.Expandable(), "stitching implies expandable segments")
}

// Growth maps whole chunks of the mapping unit, records them, and release
// gives every page and range back.
func TestGrowAndRelease(t *testing.T) {
	e := newEnv(t, vmem.Config{Expandable: true, MapUnit: 20 * MiB}, true)
	require.True(t, e.s.Expandable())
	b, err := e.malloc(t, 3*MiB, 1, false)
	require.NoError(t, err)
	require.NotNil(t, b)
	require.Equal(t, uint64(20*MiB), e.rec.mapped, "the mapping unit, in one chunk")
	require.Equal(t, 1, e.f.Sim.Handles(0))
	require.Equal(t, uint64(20*MiB), e.c.Reserved)
	require.True(t, e.s.Idle())

	e.free(b)
	require.NoError(t, e.s.UnmapFree(e.c.Large))
	require.Equal(t, uint64(20*MiB), e.rec.unmapped)
	require.Zero(t, e.f.Sim.Handles(0), "unmapped chunks are released at once")
	require.Zero(t, e.f.Sim.Mapped(0))
	n, _ := e.f.Sim.Reservations(0)
	require.Zero(t, n, "an empty range goes back")
	require.NoError(t, e.s.Release("empty_cache"))
	require.Equal(t, 1, e.prog.resets, "release forgets the streams' progress")
	require.NoError(t, e.c.Check())
}

// Growth reads the device's free memory once while plenty is left, not at
// every map; an estimate made stale by another process costs one failed
// creation, after which the next growth reads again and refuses before
// creating anything; near the limit every growth reads.
func TestGrowthReadsFreeMemoryRarely(t *testing.T) {
	const GiB = 1 << 30
	e := newEnvMemory(t, vmem.Config{Expandable: true, MapUnit: 2 * MiB}, true, 64*GiB)
	for range 5 {
		b, err := e.malloc(t, 4*MiB, 1, false)
		require.NoError(t, err)
		require.NotNil(t, b)
	}
	require.Equal(t, uint64(20*MiB), e.rec.mapped)
	require.Equal(t, 1, e.f.Calls("MemGetInfo"), "read once: 64 GiB free is far from 4 MiB")

	e.f.Sim.SetExternalUse(0, 64*GiB-20*MiB-8*MiB) // another process takes all but 8 MiB
	created := e.f.Calls("MemCreate")
	b, err := e.malloc(t, 16*MiB, 1, false)
	require.NoError(t, err)
	require.Nil(t, b, "out of memory")
	require.Equal(t, 1, e.f.Calls("MemGetInfo"), "the stale estimate let the creation try")
	require.Greater(t, e.f.Calls("MemCreate"), created)
	require.Equal(t, 10, e.f.Sim.Handles(0), "what was created for the failed growth was released")

	created = e.f.Calls("MemCreate")
	b, err = e.malloc(t, 16*MiB, 1, false)
	require.NoError(t, err)
	require.Nil(t, b)
	require.Equal(t, 2, e.f.Calls("MemGetInfo"), "read again after the failure")
	require.Equal(t, created, e.f.Calls("MemCreate"), "refused before creating anything")

	for i := range 2 { // 8 MiB free: within the margin, every growth reads
		b, err = e.malloc(t, 2*MiB, 1, false)
		require.NoError(t, err)
		require.NotNil(t, b)
		require.Equal(t, 3+i, e.f.Calls("MemGetInfo"))
	}
	require.NoError(t, e.c.Check())
}

// During a capture, where what a failed growth created would stay as
// spares, a growth that takes more than one creation reads the free memory
// afresh instead of trusting the estimate, and refuses before creating
// anything; one that takes a single creation trusts it (nothing is left if
// that one fails).
func TestCaptureGrowthReadsFreeMemoryExactly(t *testing.T) {
	const GiB = 1 << 30
	e := newEnvMemory(t, vmem.Config{Expandable: true, MapUnit: 2 * MiB}, true, 64*GiB)
	b, err := e.malloc(t, 4*MiB, 1, false)
	require.NoError(t, err)
	require.NotNil(t, b)
	require.Equal(t, 1, e.f.Calls("MemGetInfo"))
	e.f.Sim.SetExternalUse(0, 64*GiB-4*MiB-8*MiB) // another process takes all but 8 MiB

	created, handles := e.f.Calls("MemCreate"), e.f.Sim.Handles(0)
	b, err = e.malloc(t, 16*MiB, 1, true) // eight pages
	require.NoError(t, err)
	require.Nil(t, b, "out of memory")
	require.Equal(t, 2, e.f.Calls("MemGetInfo"), "read afresh")
	require.Equal(t, created, e.f.Calls("MemCreate"), "refused before creating anything")
	require.Equal(t, handles, e.f.Sim.Handles(0))
	require.True(t, e.s.Idle(), "no spares left behind")

	e.f.Sim.SetExternalUse(0, 0)
	b, err = e.malloc(t, 2*MiB, 1, true) // one page: the estimate (8 MiB free) is too close anyway
	require.NoError(t, err)
	require.NotNil(t, b)
	require.Equal(t, 3, e.f.Calls("MemGetInfo"))
	b, err = e.malloc(t, 2*MiB, 1, true) // 64 GiB free now: one creation trusts the estimate
	require.NoError(t, err)
	require.NotNil(t, b)
	require.Equal(t, 3, e.f.Calls("MemGetInfo"))
	require.NoError(t, e.c.Check())
}

// During a capture nothing is released: chunks made for a map that fails
// wait as spares (Idle is false) until Release, or the next Map uses them.
func TestCaptureKeepsSpares(t *testing.T) {
	e := newEnv(t, vmem.Config{Expandable: true, MapUnit: 2 * MiB}, true)
	injected := errors.New("injected")
	e.f.Fail("MemMap", "", 1, injected)
	_, err := e.malloc(t, 5*MiB, 1, true)
	require.ErrorIs(t, err, injected)
	require.Contains(t, err.Error(), "malloc: mapping memory for a 5242880-byte block on device 0")
	require.Equal(t, uint64(2*MiB), e.rec.mapped, "the first page stays mapped")
	require.Equal(t, 3, e.f.Sim.Handles(0))
	require.False(t, e.s.Idle(), "two spare pages")
	b, err := e.malloc(t, 5*MiB, 1, true)
	require.NoError(t, err)
	require.Equal(t, 3, e.f.Sim.Handles(0), "the spares were mapped, nothing new made")
	require.True(t, e.s.Idle())
	e.free(b)

	e.f.Fail("MemMap", "", 0, injected)
	_, err = e.malloc(t, 9*MiB, 1, true)
	require.ErrorIs(t, err, injected)
	require.False(t, e.s.Idle())
	require.NoError(t, e.s.Release("empty_cache"))
	require.True(t, e.s.Idle())
	require.NoError(t, e.s.UnmapFree(e.c.Large))
	require.Zero(t, e.f.Sim.Handles(0))
	require.NoError(t, e.c.Check())
}

// Stitching watches the streams of the default pools that grow, and asks
// for progress, naming the growth's stream (the one it may mark), before it
// looks for pages to move.
func TestStitchWatchesStreams(t *testing.T) {
	e := newEnv(t, vmem.Config{Stitch: true, MapUnit: 2 * MiB}, true)
	_, err := e.malloc(t, 3*MiB, 7, false)
	require.NoError(t, err)
	require.True(t, e.prog.Watched(7))
	require.Empty(t, e.prog.advanced, "nothing watched before the first growth")
	_, err = e.malloc(t, 3*MiB, 7, true)
	require.NoError(t, err)
	require.Empty(t, e.prog.advanced, "never during a capture")
	_, err = e.malloc(t, 3*MiB, 8, false)
	require.NoError(t, err)
	require.Equal(t, []cuda.Stream{8}, e.prog.advanced, "the growth's stream is named")
	require.True(t, e.prog.Watched(8))
	require.Zero(t, e.s.StitchStats().Remaps, "below the high-water mark nothing moves")
}

// With stitching a growth maps into the run that needs the fewest new
// pages where that saves more than a mapping unit; otherwise, and without
// stitching, into the lowest-addressed run, as PyTorch's expandable
// segments grow at their end.
func TestGrowthRunChoice(t *testing.T) {
	for _, cfg := range []vmem.Config{{Stitch: true, MapUnit: 2 * MiB}, {Stitch: true, MapUnit: 4 * MiB}, {Expandable: true, MapUnit: 2 * MiB}} {
		e := newEnv(t, cfg, true)
		const page = 2 * MiB
		var bs []*pools.Block
		for _, n := range []uint64{5, 1, 3, 3, 1} { // a, guard, b, c, guard
			b, err := e.malloc(t, n*page, 1, false)
			require.NoError(t, err)
			bs = append(bs, b)
		}
		base := bs[0].Ptr
		require.Equal(t, base+9*page, bs[3].Ptr)
		e.free(bs[0])
		e.free(bs[2])
		require.NoError(t, e.s.UnmapFree(e.c.Large)) // a's and b's pages
		e.free(bs[3])                                // c: 3 mapped pages after b's hole
		reserved := e.c.Reserved
		// 5 pages: a's hole needs 5 new ones, b's hole and c 3, the end 4
		// or 5 (with a 2-page unit a page is mapped ahead of the last
		// guard). The 2 pages saved are more than a 1-page unit, and no
		// more than a 2-page one.
		got, err := e.malloc(t, 5*page, 1, false)
		require.NoError(t, err)
		if cfg.Stitch && cfg.MapUnit == page {
			require.Equal(t, base+6*page, got.Ptr, "the run needing the fewest new pages")
			require.Equal(t, reserved+3*page, e.c.Reserved)
		} else {
			require.Equal(t, base, got.Ptr, "the lowest run")
			require.Equal(t, reserved+5*page, e.c.Reserved)
		}
		require.NoError(t, e.c.Check())
	}
}
