// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/cuda/sim/fault"
	"github.com/stretchr/testify/require"
)

// capOp is one step of a captured forward: an allocation (id, size) or the
// free of allocation id.
type capOp struct {
	alloc bool
	id    int
	size  uint64
}

// gpt2Forward is the allocation sequence of a GPT-2 small forward in bf16
// under no_grad, batch 8 x sequence 512 (bench/torch_bench.py's graph
// section): each layer's activations (6 MiB), QKV (18 MiB), MLP (24 MiB)
// and the 128 MiB logits, with cuBLAS's 32 MiB workspace taken at the first
// matmul on the capture stream.
func gpt2Forward() []capOp {
	var ops []capOp
	n := 0
	a := func(sz uint64) int { n++; ops = append(ops, capOp{true, n, sz}); return n }
	f := func(id int) { ops = append(ops, capOp{false, id, 0}) }
	const act = 8 * 512 * 768 * 2
	tok, ar := a(act), a(512*8)
	pos := a(512 * 768 * 2)
	x := a(act)
	f(tok)
	f(pos)
	f(ar)
	for l := 0; l < 12; l++ {
		ln1 := a(act)
		if l == 0 {
			a(32 * MiB) // the workspace, kept
		}
		qkv := a(3 * act)
		f(ln1)
		y, lse := a(act), a(8*12*512*4)
		yr, pr, x2 := a(act), a(act), a(act)
		for _, id := range []int{pr, yr, y, lse, qkv, x} {
			f(id)
		}
		ln2, fc := a(act), a(4*act)
		g := a(4 * act)
		f(fc)
		out := a(act)
		f(g)
		x = a(act)
		f(out)
		f(ln2)
		f(x2)
	}
	ln := a(act)
	f(x)
	a(8 * 512 * 16384 * 2)
	f(ln)
	return ops
}

// captureCalls captures gpt2Forward into a fresh private pool (after an
// eager warm-up and empty_cache, as the benchmark) and returns the driver
// calls per method made from the first allocation to the end of routing,
// and the bytes the pool holds then.
func captureCalls(t *testing.T, conf string) (map[string]int, uint64) {
	t.Helper()
	lockThread(t)
	cfg, _, err := allocator.ParseConfig(conf)
	require.NoError(t, err)
	s := sim.New(sim.Options{Devices: 1, Memory: 80 * GiB})
	f := fault.New(s)
	a, err := allocator.New(f, cfg)
	require.NoError(t, err)
	a.ExpectAnnouncements() // as PyTorch
	run := func(st cuda.Stream) {
		ptr := map[int]cuda.Ptr{}
		for _, o := range gpt2Forward() {
			if o.alloc {
				ptr[o.id] = mustMalloc(t, a, 0, o.size, st)
			} else {
				require.NoError(t, a.Free(allocator.FreeRequest{Ptr: ptr[o.id]}))
			}
		}
	}
	run(3) // the warm-up on a side stream; its blocks are freed but the workspace
	require.NoError(t, a.EmptyCache(0))
	methods := []string{"MemAddressReserve", "MemCreate", "MemMap", "MemSetAccess", "MemUnmap", "MemRelease",
		"MemGetInfo", "MemAlloc", "StreamCaptureInfo", "EventRecord", "EventQuery", "DeviceSynchronize"}
	before := map[string]int{}
	for _, m := range append(methods, "MemCreateShareable") {
		before[m] = f.Calls(m)
	}
	pool := allocator.PoolID{A: 1}
	const cs = cuda.Stream(0x7000)
	require.NoError(t, a.BeginAllocateToPool(0, pool, func(cuda.Stream) bool { return true }))
	require.NoError(t, s.BeginCapture(cs, cuda.CaptureModeGlobal))
	run(cs)
	require.NoError(t, s.EndCapture(cs), "the capture stayed valid: %v", s.ViolationLog())
	require.NoError(t, a.EndAllocateToPool(0, pool))
	calls := map[string]int{}
	for _, m := range methods {
		if n := f.Calls(m) - before[m]; n > 0 {
			calls[m] = n
		}
	}
	// Memory that may be shared is created with MemCreateShareable: a
	// creation all the same.
	if n := f.Calls("MemCreateShareable") - before["MemCreateShareable"]; n > 0 {
		calls["MemCreate"] += n
	}
	var poolBytes uint64
	for _, sg := range a.Snapshot(&pool, false).Segments {
		poolBytes += sg.TotalSize
	}
	require.NoError(t, a.CheckInvariants())
	require.Zero(t, s.Violations(), "%v", s.ViolationLog())
	return calls, poolBytes
}

// A capture that grows its private pool by ~170 MiB in steps of 6-128 MiB
// makes one cuMemCreate, one cuMemMap and one cuMemSetAccess per growth,
// fewer than PyTorch's one per 20 MiB page (it made one per 2 MiB page: 87
// of each), reads the device's free memory not once (read before the
// capture, it left plenty), and its pool holds no more than when mapped
// page by page.
func TestCaptureGrowthDriverCalls(t *testing.T) {
	calls, pool := captureCalls(t, "expandable_segments:True")
	pages, pagePool := captureCalls(t, "expandable_segments:True,expandable_map_unit_mb:2")
	t.Logf("20 MiB unit: %v, pool %d MiB; page by page: %v, pool %d MiB", calls, pool>>20, pages, pagePool>>20)
	require.LessOrEqual(t, pool, pagePool, "the pool holds no more than page by page")
	require.Equal(t, calls["MemSetAccess"], calls["MemCreate"], "one physical allocation per growth")
	require.Less(t, calls["MemCreate"], int(pool/(20*MiB)), "fewer than one per 20 MiB of %d MiB", pool>>20)
	require.Equal(t, calls["MemCreate"], calls["MemMap"], "one map per physical allocation")
	require.Zero(t, calls["MemGetInfo"])
	require.Less(t, calls["MemCreate"], pages["MemCreate"]/4)
	require.Zero(t, calls["MemUnmap"]+calls["MemRelease"], "nothing unmapped at the end: every chunk is in use")
	require.Zero(t, calls["StreamCaptureInfo"]+calls["EventRecord"]+calls["EventQuery"]+calls["DeviceSynchronize"])

	// With stitching the private pool's range is chunked all the same (it
	// never gives pages).
	st, stPool := captureCalls(t, "stitch:True")
	require.Equal(t, calls, st)
	require.Equal(t, pool, stPool)
}
