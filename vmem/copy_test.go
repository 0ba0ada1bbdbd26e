// SPDX-License-Identifier: Apache-2.0

package vmem_test

import (
	"bytes"
	"errors"
	"math/rand"
	randv2 "math/rand/v2"
	"sort"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
	"github.com/cudapool/cudapool/vmem"
)

const (
	cpKiB  = uint64(1) << 10
	cpMiB  = uint64(1) << 20
	cpGiB  = uint64(1) << 30
	cpGran = uint64(sim.Granularity)
)

var (
	_ vmem.CopyDriver = (*sim.Driver)(nil)
	_ vmem.CopyDriver = (*fault.Driver)(nil)
)

// ---- the plan ----

func TestCopyPlanMerges(t *testing.T) {
	p, err := vmem.PlanCopies([]vmem.CopyRange{
		{Dev: 0, Ptr: 0x10000, Size: 0x1000},
		{Dev: 1, Ptr: 0x10000, Size: 0x1000}, // another device: apart
		{Dev: 0, Ptr: 0x11000, Size: 0x1000}, // touches the first
		{Dev: 0, Ptr: 0x11800, Size: 0x2000}, // overlaps
		{Dev: 0, Ptr: 0x12000, Size: 0x100},  // inside
		{Dev: 0, Ptr: 0x20000, Size: 0},      // empty
		{Dev: 0, Ptr: 0x30000, Size: 0x10},   // apart
		{Dev: 0, Ptr: 0x0f000, Size: 0x1000}, // before, touches (unsorted input)
		{Dev: 0, Ptr: 0x50000, Size: 0x10, Seg: 7},
		{Dev: 0, Ptr: 0x58000, Size: 0x10, Seg: 7}, // a gap of one Seg: merged
		{Dev: 0, Ptr: 0x60000, Size: 0x10, Seg: 8}, // another Seg: apart
		{Dev: 0, Ptr: 0x90000, Size: 0x10, Seg: 8}, // gap > MaxGap: apart
		{Dev: 0, Ptr: 0x90020, Size: 0x10},         // Seg 0: never bridged
	}, vmem.CopyOptions{MaxGap: 64 * cpKiB})
	require.NoError(t, err)
	want := []vmem.CopySpan{
		{Dev: 0, Ptr: 0x0f000, Size: 0x4800},
		{Dev: 0, Ptr: 0x30000, Size: 0x10},
		{Dev: 0, Ptr: 0x50000, Size: 0x8010},
		{Dev: 0, Ptr: 0x60000, Size: 0x10},
		{Dev: 0, Ptr: 0x90000, Size: 0x10},
		{Dev: 0, Ptr: 0x90020, Size: 0x10},
		{Dev: 1, Ptr: 0x10000, Size: 0x1000},
	}
	assert.Equal(t, want, p.Spans)
	assert.Equal(t, uint64(0x4800+0x10+0x20+0x10+0x10+0x10+0x1000), p.Live)
	assert.Equal(t, p.Live+0x8000-0x10, p.Bytes, "the bridged gap is copied")
	assert.Equal(t, 0x4800+0x8200+0x1000+4*uint64(vmem.CopyAlign), p.Host)

	_, err = vmem.PlanCopies([]vmem.CopyRange{{Ptr: ^cuda.Ptr(0) - 10, Size: 100}}, vmem.CopyOptions{})
	assert.Error(t, err, "wraps around")
	_, err = vmem.PlanCopies([]vmem.CopyRange{{Dev: -1, Ptr: 0x1000, Size: 1}}, vmem.CopyOptions{})
	assert.Error(t, err)
	p, err = vmem.PlanCopies(nil, vmem.CopyOptions{})
	require.NoError(t, err)
	assert.Zero(t, p.Bytes)
	require.NoError(t, p.Layout(nil, vmem.CopyOptions{}))
	assert.Empty(t, p.Pieces)
}

func TestCopyLayout(t *testing.T) {
	p, err := vmem.PlanCopies([]vmem.CopyRange{
		{Dev: 0, Ptr: 0x100000, Size: 10 * cpMiB},
		{Dev: 0, Ptr: 0x2000000, Size: 100},
		{Dev: 1, Ptr: 0x100000, Size: 3 * cpMiB},
	}, vmem.CopyOptions{})
	require.NoError(t, err)
	opt := vmem.CopyOptions{Chunk: 4 * cpMiB, Streams: 3}
	require.Error(t, p.Layout([]uint64{8 * cpMiB, 4 * cpMiB}, opt), "too small")
	require.NoError(t, p.Layout([]uint64{6 * cpMiB, 4 * cpMiB, 4 * cpMiB}, opt))
	want := []vmem.CopyPiece{
		{Dev: 0, Ptr: 0x100000, Size: 4 * cpMiB, Block: 0, Off: 0, Stream: 0},
		{Dev: 0, Ptr: 0x500000, Size: 2 * cpMiB, Block: 0, Off: 4 * cpMiB, Stream: 1}, // block end
		{Dev: 0, Ptr: 0x700000, Size: 4 * cpMiB, Block: 1, Off: 0, Stream: 2},
		{Dev: 0, Ptr: 0x2000000, Size: 100, Block: 2, Off: 0, Stream: 0},
		{Dev: 1, Ptr: 0x100000, Size: 3 * cpMiB, Block: 2, Off: 512, Stream: 0}, // aligned; streams per device
	}
	assert.Equal(t, want, p.Pieces)
}

// Random ranges and blocks: the pieces tile the spans in order, stay inside
// their blocks without overlapping, respect the chunk size, and deal each
// device's pieces round-robin.
func TestCopyLayoutProperties(t *testing.T) {
	rng := rand.New(rand.NewSource(3))
	for iter := range 200 {
		var rs []vmem.CopyRange
		for range rng.Intn(60) {
			rs = append(rs, vmem.CopyRange{
				Dev:  rng.Intn(3),
				Ptr:  cuda.Ptr(rng.Intn(1<<16) * 512),
				Size: uint64(rng.Intn(4 << 20)),
				Seg:  uint64(rng.Intn(3)),
			})
		}
		opt := vmem.CopyOptions{Chunk: uint64(1+rng.Intn(8)) * 512 * 1024, Streams: 1 + rng.Intn(4), MaxGap: uint64(rng.Intn(1 << 20))}
		p, err := vmem.PlanCopies(rs, opt)
		require.NoError(t, err)
		var blocks []uint64
		for total := uint64(0); total < p.Host; {
			b := uint64(1+rng.Intn(16)) * 512 * 1024
			blocks = append(blocks, b)
			total += b
		}
		require.NoError(t, p.Layout(blocks, opt), "iteration %d", iter)

		// Every byte asked for is in a span.
		for _, r := range rs {
			if r.Size == 0 {
				continue
			}
			i := sort.Search(len(p.Spans), func(i int) bool {
				s := p.Spans[i]
				return s.Dev > r.Dev || s.Dev == r.Dev && uint64(s.Ptr)+s.Size > uint64(r.Ptr)
			})
			require.Less(t, i, len(p.Spans))
			s := p.Spans[i]
			require.True(t, s.Dev == r.Dev && s.Ptr <= r.Ptr && uint64(r.Ptr)+r.Size <= uint64(s.Ptr)+s.Size, "range %+v not in a span", r)
		}
		// The pieces tile the spans.
		k := 0
		type hostByte struct {
			block int
			off   uint64
		}
		var lastEnd *hostByte
		dealt := map[int]int{}
		var total uint64
		for _, s := range p.Spans {
			for ptr := s.Ptr; ptr < s.Ptr+cuda.Ptr(s.Size); {
				pc := p.Pieces[k]
				require.Equal(t, s.Dev, pc.Dev)
				require.Equal(t, ptr, pc.Ptr)
				require.LessOrEqual(t, pc.Size, opt.Chunk)
				require.LessOrEqual(t, pc.Off+pc.Size, blocks[pc.Block])
				require.Equal(t, dealt[pc.Dev]%opt.Streams, pc.Stream)
				dealt[pc.Dev]++
				if lastEnd != nil {
					require.True(t, pc.Block > lastEnd.block || pc.Block == lastEnd.block && pc.Off >= lastEnd.off, "host regions overlap")
				}
				lastEnd = &hostByte{pc.Block, pc.Off + pc.Size}
				ptr += cuda.Ptr(pc.Size)
				total += pc.Size
				k++
			}
		}
		require.Len(t, p.Pieces, k)
		require.Equal(t, p.Bytes, total)
	}
}

// ---- copies over the simulator, with contents ----

// cpExtent is memory mapped on the simulator as a pause and resume would
// see it: physical memory in granules, mapped and accessible.
type cpExtent struct {
	d       *sim.Driver
	dev     int
	base    cuda.Ptr
	size    uint64
	handles []cuda.MemHandle
}

func newCPExtent(t *testing.T, d *sim.Driver, dev int, size, handle uint64) *cpExtent {
	t.Helper()
	base, err := d.MemAddressReserve(dev, size)
	require.NoError(t, err)
	e := &cpExtent{d: d, dev: dev, base: base, size: size}
	e.mapNew(t, handle)
	return e
}

// mapNew maps new physical memory over the whole cpExtent in handles of the
// given size, as a resume does.
func (e *cpExtent) mapNew(t *testing.T, handle uint64) {
	t.Helper()
	e.handles = nil
	for off := uint64(0); off < e.size; off += handle {
		h, err := e.d.MemCreate(e.dev, handle)
		require.NoError(t, err)
		require.NoError(t, e.d.MemMap(e.dev, e.base+cuda.Ptr(off), handle, h))
		e.handles = append(e.handles, h)
	}
	require.NoError(t, e.d.MemSetAccess(e.dev, e.base, e.size))
}

// drop unmaps and releases the physical memory, as a pause does.
func (e *cpExtent) drop(t *testing.T) {
	t.Helper()
	require.NoError(t, e.d.MemUnmap(e.dev, e.base, e.size))
	for _, h := range e.handles {
		require.NoError(t, e.d.MemRelease(e.dev, h))
	}
	e.handles = nil
}

// fill writes random bytes into ranges and returns them.
func cpFill(t *testing.T, d *sim.Driver, rng *rand.Rand, rs []vmem.CopyRange) [][]byte {
	t.Helper()
	out := make([][]byte, len(rs))
	for i, r := range rs {
		out[i] = cpNoise(rng, r.Size)
		require.NoError(t, d.WriteDevice(r.Dev, r.Ptr, out[i]))
	}
	return out
}

// noise returns n random bytes (ChaCha8: fast, also under -race).
func cpNoise(rng *rand.Rand, n uint64) []byte {
	var seed [32]byte
	rng.Read(seed[:])
	b := make([]byte, n)
	_, _ = randv2.NewChaCha8(seed).Read(b)
	return b
}

// same checks that ranges hold want.
func cpSame(t *testing.T, d *sim.Driver, rs []vmem.CopyRange, want [][]byte) {
	t.Helper()
	for i, r := range rs {
		got, err := d.ReadDevice(r.Dev, r.Ptr, r.Size)
		require.NoError(t, err)
		require.True(t, bytes.Equal(want[i], got), "range %d (%#x+%d on device %d) differs", i, uint64(r.Ptr), r.Size, r.Dev)
	}
}

// randomRanges returns up to n disjoint ranges in e (live blocks: many
// small, a few large), with e's Seg.
func cpRandomRanges(rng *rand.Rand, e *cpExtent, n int, seg uint64) []vmem.CopyRange {
	var rs []vmem.CopyRange
	off := uint64(rng.Intn(8)) * 512
	for range n {
		size := uint64(1+rng.Intn(64)) * 512
		if rng.Intn(50) == 0 {
			size = uint64(1+rng.Intn(4)) * cpMiB
		}
		if off+size > e.size {
			break
		}
		rs = append(rs, vmem.CopyRange{Dev: e.dev, Ptr: e.base + cuda.Ptr(off), Size: size, Seg: seg})
		off += size + uint64(rng.Intn(4))*uint64(rng.Intn(64))*512 // often adjacent
	}
	rng.Shuffle(len(rs), func(i, j int) { rs[i], rs[j] = rs[j], rs[i] })
	return rs
}

// Save, drop the physical memory, map new memory (garbage written over
// it), Restore: every byte of every range is back. A second cycle reuses
// the pinned memory; ReleaseHost frees it.
func TestCopySaveRestoreRandom(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2})
	rng := rand.New(rand.NewSource(7))
	exts := []*cpExtent{newCPExtent(t, d, 0, 24*cpMiB, cpGran), newCPExtent(t, d, 1, 16*cpMiB, 8*cpMiB)}
	var rs []vmem.CopyRange
	for i, e := range exts {
		rs = append(rs, cpRandomRanges(rng, e, 1000, uint64(i+1))...)
	}
	want := cpFill(t, d, rng, rs)
	c := vmem.NewCopier(d, vmem.CopyOptions{Chunk: 512 * cpKiB, Streams: 3, HostBlock: 4 * cpMiB})

	for cycle := range 2 {
		calls := d.HostAllocCalls()
		s, err := c.Save(rs)
		require.NoError(t, err)
		if cycle == 1 {
			assert.Equal(t, calls, d.HostAllocCalls(), "the second pause reuses the pinned memory")
		}
		assert.GreaterOrEqual(t, s.Bytes(), s.Live())
		assert.Greater(t, s.Pieces(), 2*3, "several pieces per device")
		st := c.Stats()
		assert.Equal(t, s.HostBytes(), st.Held)
		assert.Equal(t, 6, st.Streams)
		for _, e := range exts {
			e.drop(t)
			e.mapNew(t, cpGran)
			require.NoError(t, d.WriteDevice(e.dev, e.base, cpNoise(rng, e.size)))
		}
		require.NoError(t, c.Restore(s))
		cpSame(t, d, rs, want)
		st = c.Stats()
		assert.Zero(t, st.Held)
		assert.Equal(t, s.Bytes()*2, cpCopiedBytes(d)/uint64(cycle+1), "each byte copied once each way")
		require.Error(t, c.Restore(s), "restored twice")
	}
	assert.Zero(t, d.Violations())
	n, b := d.HostMemory()
	assert.Equal(t, c.Stats().Pooled, b)
	assert.NotZero(t, n)
	freed, err := c.ReleaseHost()
	require.NoError(t, err)
	assert.Equal(t, b, freed)
	n, _ = d.HostMemory()
	assert.Zero(t, n)
	require.NoError(t, c.Close())
	assert.Zero(t, d.CopyStreams())
}

func cpCopiedBytes(d *sim.Driver) uint64 {
	_, b := d.Copies()
	return b
}

// Nothing to save: no pinned memory, no streams, no copies.
func TestCopySaveNothing(t *testing.T) {
	d := sim.New(sim.Options{})
	c := vmem.NewCopier(d, vmem.CopyOptions{})
	for _, rs := range [][]vmem.CopyRange{nil, {{Ptr: 0x1000, Size: 0}}} {
		s, err := c.Save(rs)
		require.NoError(t, err)
		assert.Zero(t, s.Bytes())
		require.NoError(t, c.Restore(s))
	}
	assert.Zero(t, d.HostAllocCalls())
	assert.Zero(t, d.CopyStreams())
	n, _ := d.Copies()
	assert.Zero(t, n)
}

// Huge ranges on two devices: 64 MiB pieces, dealt to both streams of each
// device, in 256 MiB pinned blocks; the bytes at the ends and in the middle
// come back.
func TestCopySaveRestoreHuge(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2, Memory: 80 * cpGiB})
	e0 := newCPExtent(t, d, 0, 20*cpGiB, 20*cpGiB)
	e1 := newCPExtent(t, d, 1, 8*cpGiB, 2*cpGiB)
	rs := []vmem.CopyRange{
		{Dev: 0, Ptr: e0.base, Size: 20 * cpGiB},
		{Dev: 1, Ptr: e1.base + 4096, Size: 8*cpGiB - 8192},
	}
	var marks []vmem.CopyRange
	for _, r := range rs {
		for _, off := range []uint64{0, r.Size/2 - 3, r.Size - 16} {
			marks = append(marks, vmem.CopyRange{Dev: r.Dev, Ptr: r.Ptr + cuda.Ptr(off), Size: 16})
		}
	}
	rng := rand.New(rand.NewSource(1))
	want := cpFill(t, d, rng, marks)
	c := vmem.NewCopier(d, vmem.CopyOptions{})
	s, err := c.Save(rs)
	require.NoError(t, err)
	assert.Equal(t, 320+128, s.Pieces())
	assert.Equal(t, 28*cpGiB-8192, s.Bytes())
	assert.Equal(t, 28*cpGiB, s.HostBytes(), "112 blocks of 256 MiB")
	assert.Equal(t, int64(112), d.HostAllocCalls())
	e0.drop(t)
	e1.drop(t)
	e0.mapNew(t, 4*cpGiB)
	e1.mapNew(t, cpGran*512)
	require.NoError(t, c.Restore(s))
	cpSame(t, d, marks, want)
	assert.Zero(t, d.Violations())
}

// A pause that fails while copying leaves the device contents as they
// were: unmapping comes only after Save succeeded. Each failure point of
// the copy engine is tried.
func TestCopySaveFaults(t *testing.T) {
	for _, tc := range []struct {
		method   string
		skip     int
		stranded bool // the blocks cannot be reused
		pooled   bool // the blocks allocated before the fault are pooled
	}{
		{method: "StreamCreate", skip: 1},
		{method: "HostAlloc", skip: 2, pooled: true},
		{method: "MemcpyDtoHAsync", skip: 0, pooled: true},
		{method: "MemcpyDtoHAsync", skip: 9, pooled: true},
		{method: "StreamSynchronize", skip: 1, stranded: true},
	} {
		t.Run(tc.method, func(t *testing.T) {
			s := sim.New(sim.Options{})
			d := fault.New(s)
			rng := rand.New(rand.NewSource(2))
			e := newCPExtent(t, s, 0, 16*cpMiB, cpGran)
			rs := cpRandomRanges(rng, e, 300, 1)
			want := cpFill(t, s, rng, rs)
			opt := vmem.CopyOptions{Chunk: 512 * cpKiB, HostBlock: 2 * cpMiB}
			c := vmem.NewCopier(d, opt)
			plan, err := vmem.PlanCopies(rs, opt)
			require.NoError(t, err)
			blocks := int64((plan.Host + 2*cpMiB - 1) / (2 * cpMiB))
			require.Greater(t, blocks, int64(2))

			r := d.Fail(tc.method, "", tc.skip, cuda.ErrUnknown)
			saved, err := c.Save(rs)
			require.ErrorIs(t, err, cuda.ErrUnknown)
			require.Nil(t, saved)
			require.Equal(t, 1, d.Hits(r))
			cpSame(t, s, rs, want)
			st := c.Stats()
			assert.Zero(t, st.Held)
			_, hostBytes := s.HostMemory()
			if tc.stranded {
				assert.Equal(t, hostBytes, st.Stranded)
				assert.Zero(t, st.Pooled)
			} else {
				assert.Zero(t, st.Stranded)
				assert.Equal(t, hostBytes, st.Pooled, "every pinned block back in the pool")
				assert.Equal(t, tc.pooled, st.Pooled > 0)
			}
			if tc.stranded {
				s.CompleteAll() // the copies the failed wait left running end
			}
			// Nothing is left running on the memory: it can be unmapped.
			e.drop(t)
			e.mapNew(t, cpGran)
			require.NoError(t, s.WriteDevice(0, e.base, make([]byte, e.size)))
			fill2 := cpFill(t, s, rng, rs)

			// The next pause works and reuses what the pool kept.
			saved, err = c.Save(rs)
			require.NoError(t, err)
			if tc.stranded {
				assert.Equal(t, 2*blocks, c.Stats().HostAllocs, "stranded blocks are not reused")
			} else {
				assert.Equal(t, blocks, c.Stats().HostAllocs, "pooled blocks reused")
			}
			e.drop(t)
			e.mapNew(t, cpGran)
			require.NoError(t, c.Restore(saved))
			cpSame(t, s, rs, fill2)
			assert.Zero(t, s.Violations())
		})
	}
}

// A resume that fails while copying back keeps the saved contents, and a
// second try restores them all.
func TestCopyRestoreFaults(t *testing.T) {
	for _, method := range []string{"StreamCreate", "MemcpyHtoDAsync", "StreamSynchronize"} {
		t.Run(method, func(t *testing.T) {
			s := sim.New(sim.Options{})
			d := fault.New(s)
			rng := rand.New(rand.NewSource(4))
			e := newCPExtent(t, s, 0, 32*cpMiB, cpGran)
			rs := cpRandomRanges(rng, e, 300, 0)
			want := cpFill(t, s, rng, rs)
			c := vmem.NewCopier(d, vmem.CopyOptions{Chunk: cpMiB})
			saved, err := c.Save(rs)
			require.NoError(t, err)
			e.drop(t)
			e.mapNew(t, cpGran)
			if method == "StreamCreate" {
				require.NoError(t, c.Close()) // the streams are made again by Restore
			}
			r := d.Fail(method, "", 3*cpBtoi(method == "MemcpyHtoDAsync"), cuda.ErrUnknown)
			require.ErrorIs(t, c.Restore(saved), cuda.ErrUnknown)
			require.Equal(t, 1, d.Hits(r))
			assert.Equal(t, saved.HostBytes(), c.Stats().Held, "the contents are still held")
			require.NoError(t, c.Restore(saved))
			cpSame(t, s, rs, want)
			assert.Zero(t, c.Stats().Held)
		})
	}
}

func cpBtoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Random failures of every copy-engine call over many pause/resume
// cycles: a failed save leaves the device intact, a failed restore can be
// retried, and pinned memory is either pooled, held or stranded, never
// lost track of.
func TestCopyRandomFaults(t *testing.T) {
	s := sim.New(sim.Options{})
	d := fault.New(s)
	rng := rand.New(rand.NewSource(5))
	e := newCPExtent(t, s, 0, 8*cpMiB, cpGran)
	c := vmem.NewCopier(d, vmem.CopyOptions{Chunk: 256 * cpKiB, Streams: 2, HostBlock: 2 * cpMiB})
	d.FailRandomly(0.003, 9, cuda.ErrUnknown, "HostAlloc", "StreamCreate", "MemcpyDtoHAsync", "MemcpyHtoDAsync", "StreamSynchronize")
	for range 30 {
		rs := cpRandomRanges(rng, e, 100, uint64(rng.Intn(2)))
		want := cpFill(t, s, rng, rs)
		var saved *vmem.Saved
		for {
			var err error
			if saved, err = c.Save(rs); err == nil {
				break
			}
			require.ErrorIs(t, err, cuda.ErrUnknown)
			cpSame(t, s, rs, want)
		}
		e.drop(t)
		e.mapNew(t, cpGran)
		for {
			err := c.Restore(saved)
			if err == nil {
				break
			}
			require.ErrorIs(t, err, cuda.ErrUnknown)
		}
		cpSame(t, s, rs, want)
	}
	require.Positive(t, d.RandomHits())
	d.Clear()
	st := c.Stats()
	_, hostBytes := s.HostMemory()
	assert.Zero(t, st.Held)
	assert.Equal(t, hostBytes, st.Pooled+st.Stranded)
	assert.Zero(t, s.Violations())
}

func TestCopyDiscard(t *testing.T) {
	d := sim.New(sim.Options{})
	e := newCPExtent(t, d, 0, 8*cpMiB, cpGran)
	c := vmem.NewCopier(d, vmem.CopyOptions{})
	s, err := c.Save([]vmem.CopyRange{{Ptr: e.base, Size: 3 * cpMiB}})
	require.NoError(t, err)
	assert.Equal(t, 4*cpMiB, c.Stats().Held)
	require.NoError(t, c.Discard(s))
	assert.Equal(t, vmem.CopyStats{Pooled: 4 * cpMiB, HostAllocs: 1, Streams: 2}, c.Stats())
	require.Error(t, c.Restore(s))
	require.Error(t, c.Discard(s))
	other := vmem.NewCopier(d, vmem.CopyOptions{})
	s, err = c.Save([]vmem.CopyRange{{Ptr: e.base, Size: cpMiB}})
	require.NoError(t, err)
	require.Error(t, other.Restore(s), "another copier's save")
	require.NoError(t, c.Restore(s))
}

// Pools grow when a save needs more, and a small save takes the smallest
// block that holds it.
func TestCopyHostPool(t *testing.T) {
	d := sim.New(sim.Options{})
	e := newCPExtent(t, d, 0, 64*cpMiB, cpGran)
	c := vmem.NewCopier(d, vmem.CopyOptions{HostBlock: 16 * cpMiB})
	big, err := c.Save([]vmem.CopyRange{{Ptr: e.base, Size: 40 * cpMiB}})
	require.NoError(t, err)
	assert.Equal(t, 40*cpMiB, big.HostBytes(), "16+16+8 MiB")
	assert.Equal(t, int64(3), c.Stats().HostAllocs)
	small, err := c.Save([]vmem.CopyRange{{Ptr: e.base, Size: 100}})
	require.NoError(t, err)
	assert.Equal(t, 2*cpMiB, small.HostBytes())
	require.NoError(t, c.Restore(big))
	require.NoError(t, c.Restore(small))
	small, err = c.Save([]vmem.CopyRange{{Ptr: e.base, Size: 5 * cpMiB}})
	require.NoError(t, err)
	assert.Equal(t, 8*cpMiB, small.HostBytes(), "best fit")
	bigger, err := c.Save([]vmem.CopyRange{{Ptr: e.base, Size: 60 * cpMiB}})
	require.NoError(t, err)
	assert.Equal(t, 60*cpMiB, bigger.HostBytes(), "16+16+2 pooled, 16+10 new")
	assert.Equal(t, int64(6), c.Stats().HostAllocs)
	require.NoError(t, c.Discard(small))
	require.NoError(t, c.Discard(bigger))

	// The pool holds 68 MiB; at the limit, a save beyond it fails.
	d.SetHostLimit(68 * cpMiB)
	_, err = c.Save([]vmem.CopyRange{{Ptr: e.base, Size: cpMiB}})
	require.NoError(t, err, "the 2 MiB block")
	_, err = c.Save([]vmem.CopyRange{{Ptr: e.base, Size: 64 * cpMiB}, {Dev: 0, Ptr: e.base, Size: 8 * cpMiB}})
	require.NoError(t, err, "64 MiB in the pool's other 66")
	assert.Equal(t, int64(6), c.Stats().HostAllocs)
	_, err = c.Save([]vmem.CopyRange{{Ptr: e.base, Size: cpMiB}})
	require.ErrorIs(t, err, cuda.ErrOutOfMemory)
}

// Saves and restores from several goroutines share one copier (-race).
func TestCopyConcurrent(t *testing.T) {
	d := sim.New(sim.Options{Devices: 2})
	c := vmem.NewCopier(d, vmem.CopyOptions{Chunk: cpMiB, HostBlock: 4 * cpMiB})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 4 {
		e := newCPExtent(t, d, g%2, 8*cpMiB, cpGran)
		rng := rand.New(rand.NewSource(int64(g)))
		rs := cpRandomRanges(rng, e, 100, 1)
		want := cpFill(t, d, rng, rs)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 3 {
				s, err := c.Save(rs)
				if err != nil {
					errs <- err
					return
				}
				if err := d.WriteDevice(e.dev, e.base, make([]byte, e.size)); err != nil {
					errs <- err
					return
				}
				if err := c.Restore(s); err != nil {
					errs <- err
					return
				}
				for i, r := range rs {
					got, err := d.ReadDevice(r.Dev, r.Ptr, r.Size)
					if err != nil || !bytes.Equal(got, want[i]) {
						errs <- errors.Join(err, errors.New("contents differ"))
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	assert.Zero(t, c.Stats().Held)
}
