// SPDX-License-Identifier: Apache-2.0

// Command simreplay replays allocation traces (the format of demo/trace.txt)
// through cudapool on the simulator, once per configuration, and prints peak
// reserved / peak allocated, the driver work and stitching's remaps: the
// simulator side of docs/fragmentation.md.
//
//	go run ./bench/simreplay [-repeats 3] [-conf CONF]... TRACE...
//
// A TRACE whose name ends in .gz is read through gzip (demo/train75.txt.gz,
// demo/fsdp2.txt.gz).
//
// Without -conf it runs cudapool's four configurations: ordinary segments,
// expandable segments without stitching mapping page by page and 20 MiB at
// a time, and the default (expandable segments with stitching). Each
// configuration starts from a fresh allocator; every pass replays the whole
// trace and frees what the trace left live. Time is the host time on this
// machine with the simulated driver (no GPU): it counts the allocator's
// work, not CUDA's. The "later" columns are per pass after the first: a
// loop replaying the trace, once its pools have taken shape.
//
// -lag N models a GPU running behind the host: every allocation is used by
// a kernel on its stream, and the device completes the work submitted so far
// only every N operations, so stitching finds only the pages that its marker
// events certify idle (0: the GPU keeps up, every stream is always idle).
package main

import (
	"bufio"
	"compress/gzip"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
)

type op struct {
	alloc  bool
	slot   int // alloc: its slot; free: its alloc's slot
	size   uint64
	stream cuda.Stream
}

func load(path string) ([]op, int, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	var r io.Reader = f
	if strings.HasSuffix(path, ".gz") {
		z, err := gzip.NewReader(f)
		if err != nil {
			return nil, 0, fmt.Errorf("%s: %w", path, err)
		}
		defer z.Close()
		r = z
	}
	var ops []op
	ids := map[uint64]int{}
	slots := 0
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		fs := strings.Fields(sc.Text())
		if len(fs) == 0 || strings.HasPrefix(fs[0], "#") {
			continue
		}
		bad := fmt.Errorf("%s:%d: expected 'a ID SIZE STREAM' or 'f ID'", path, n)
		id, err := strconv.ParseUint(fs[min(1, len(fs)-1)], 0, 64)
		switch {
		case err != nil:
			return nil, 0, bad
		case fs[0] == "a" && len(fs) == 4:
			size, err1 := strconv.ParseUint(fs[2], 0, 64)
			s, err2 := strconv.ParseUint(fs[3], 0, 64)
			if err1 != nil || err2 != nil {
				return nil, 0, bad
			}
			ids[id] = slots
			ops = append(ops, op{alloc: true, slot: slots, size: size, stream: cuda.Stream(s)})
			slots++
		case fs[0] == "f" && len(fs) == 2:
			if s, ok := ids[id]; ok {
				ops = append(ops, op{slot: s})
				delete(ids, id)
			}
		default:
			return nil, 0, bad
		}
	}
	return ops, slots, sc.Err()
}

type result struct {
	peakAlloc, peakRes    int64
	maps, unmaps          int64
	remaps, stitches      int64
	syncs                 int64 // device synchronizations for other streams' pages
	firstNs, laterNsPerOp float64
	failed                int
	// Per pass after the first (the steady state of a loop that replays
	// the trace): page moves, mapping plus unmapping calls,
	// synchronizations, and the driver's host time those would take on a
	// GPU (driverMs).
	laterRemaps, laterCalls, laterSyncs, laterDriverMs float64
}

// The host time of the driver's mapping work on an H100 (driver 580),
// measured inside a training process (docs/fragmentation.md, "What a
// page move costs"): per cuMemMap call, per mapping cuMemSetAccess covers,
// and per accessible mapping cuMemUnmap removes. A synchronization's cost
// depends on the work queued, so it is counted, not priced.
const (
	usPerMap      = 1.5
	usPerAccess   = 32
	usPerUnmapped = 26
)

// driverMs prices drv's mapping work on device 0 so far (see above).
func driverMs(drv *sim.Driver) float64 {
	maps, _ := drv.MapCalls(0)
	accessed, unmapped := drv.MappingWork(0)
	return (float64(maps)*usPerMap + float64(accessed)*usPerAccess + float64(unmapped)*usPerUnmapped) / 1000
}

// counters reads the totals a pass's figures are differences of: page
// moves, mapping plus unmapping calls, and synchronizations.
func counters(a *allocator.Allocator) (remaps, calls, syncs int64, err error) {
	st, err := a.Stats(0)
	if err != nil {
		return 0, 0, 0, err
	}
	ss, err := a.StitchStats(0)
	if err != nil {
		return 0, 0, 0, err
	}
	return ss.Remaps, st.NumDeviceAlloc + st.NumDeviceFree, ss.Syncs, nil
}

func replay(ops []op, slots int, conf string, repeats, lag int) (result, error) {
	var res result
	cfg, _, err := allocator.ParseConfig(conf)
	if err != nil {
		return res, err
	}
	drv := sim.New(sim.Options{Memory: 80 << 30})
	a, err := allocator.New(drv, cfg)
	if err != nil {
		return res, err
	}
	a.SetWarningHandler(func(string) {})
	a.ExpectAnnouncements() // as PyTorch: no capture-status query per malloc
	ptrs := make([]cuda.Ptr, slots)
	var later time.Duration
	var remaps1, calls1, syncs1 int64 // after the first pass
	var driver1 float64
	for r := 0; r < repeats; r++ {
		t0 := time.Now()
		for i, o := range ops {
			if lag > 0 && i%lag == 0 {
				drv.CompleteAll()
			}
			if o.alloc {
				p, err := a.Malloc(&allocator.MallocRequest{Size: o.size, Stream: o.stream})
				if err != nil {
					res.failed++
				}
				ptrs[o.slot] = p
				if lag > 0 && p != 0 {
					drv.Use(0, o.stream, p, o.size)
				}
			} else if p := ptrs[o.slot]; p != 0 {
				if err := a.Free(allocator.FreeRequest{Ptr: p}); err != nil {
					return res, err
				}
				ptrs[o.slot] = 0
			}
		}
		dt := time.Since(t0)
		if r == 0 {
			res.firstNs = float64(dt.Nanoseconds())
		} else {
			later += dt
		}
		drv.CompleteAll()
		for i, p := range ptrs {
			if p != 0 {
				if err := a.Free(allocator.FreeRequest{Ptr: p}); err != nil {
					return res, err
				}
				ptrs[i] = 0
			}
		}
		if r == 0 {
			if remaps1, calls1, syncs1, err = counters(a); err != nil {
				return res, err
			}
			driver1 = driverMs(drv)
		}
	}
	st, err := a.Stats(0)
	if err != nil {
		return res, err
	}
	res.peakAlloc = st.AllocatedBytes[pools.StatAll].Peak
	res.peakRes = st.ReservedBytes[pools.StatAll].Peak
	ss, err := a.StitchStats(0)
	if err != nil {
		return res, err
	}
	res.remaps, res.stitches, res.syncs = ss.Remaps, ss.Stitches, ss.Syncs
	res.maps, res.unmaps = st.NumDeviceAlloc, st.NumDeviceFree
	if repeats > 1 {
		res.laterNsPerOp = float64(later.Nanoseconds()) / float64(len(ops)*(repeats-1))
		res.laterRemaps = float64(res.remaps-remaps1) / float64(repeats-1)
		res.laterCalls = float64(res.maps+res.unmaps-calls1) / float64(repeats-1)
		res.laterSyncs = float64(res.syncs-syncs1) / float64(repeats-1)
		res.laterDriverMs = (driverMs(drv) - driver1) / float64(repeats-1)
	}
	return res, a.EmptyCache(0)
}

// capture replays n operations of ops from the from-th inside a CUDA graph
// capture (every allocation routed to the graph's private pool, as
// torch.cuda.graph does), and returns the pool's mapped or allocated
// memory and the driver mapping calls made (one cuMemSetAccess each).
func capture(ops []op, slots int, conf string, from, n int) (poolBytes uint64, mapCalls int64, err error) {
	cfg, _, err := allocator.ParseConfig(conf)
	if err != nil {
		return 0, 0, err
	}
	drv := sim.New(sim.Options{Memory: 80 << 30})
	a, err := allocator.New(drv, cfg)
	if err != nil {
		return 0, 0, err
	}
	a.SetWarningHandler(func(string) {})
	a.ExpectAnnouncements()
	runtime.LockOSThread() // the simulator's capture modes are per OS thread
	defer runtime.UnlockOSThread()
	pool := allocator.PoolID{A: 1}
	const cs = cuda.Stream(0x7000)
	if err := a.BeginAllocateToPool(0, pool, func(cuda.Stream) bool { return true }); err != nil {
		return 0, 0, err
	}
	if err := drv.BeginCapture(cs, cuda.CaptureModeGlobal); err != nil {
		return 0, 0, err
	}
	st0, _ := a.Stats(0)
	ptrs := make([]cuda.Ptr, slots)
	for _, o := range ops[min(from, len(ops)):min(from+n, len(ops))] {
		if o.alloc {
			if ptrs[o.slot], err = a.Malloc(&allocator.MallocRequest{Size: o.size, Stream: cs}); err != nil {
				return 0, 0, err
			}
		} else if p := ptrs[o.slot]; p != 0 {
			if err := a.Free(allocator.FreeRequest{Ptr: p}); err != nil {
				return 0, 0, err
			}
		}
	}
	if err := drv.EndCapture(cs); err != nil {
		return 0, 0, fmt.Errorf("the capture was invalidated: %v (%v)", err, drv.ViolationLog())
	}
	if err := a.EndAllocateToPool(0, pool); err != nil {
		return 0, 0, err
	}
	st, _ := a.Stats(0)
	for _, sg := range a.Snapshot(&pool, false).Segments {
		poolBytes += sg.TotalSize
	}
	return poolBytes, st.NumDeviceAlloc - st0.NumDeviceAlloc, nil
}

type confs []string

func (c *confs) String() string     { return strings.Join(*c, " ") }
func (c *confs) Set(s string) error { *c = append(*c, s); return nil }

func main() {
	repeats := flag.Int("repeats", 3, "passes over each trace")
	graph := flag.Int("graph", 0, "also replay N operations of each trace inside a graph capture")
	graphFrom := flag.Int("graph-from", 0, "the first operation -graph replays (frees of earlier blocks are skipped)")
	lag := flag.Int("lag", 0, "the device completes work only every N operations (0: always idle)")
	var cs confs
	flag.Var(&cs, "conf", "a cudapool configuration (repeatable; default: the four of the table)")
	flag.Parse()
	if flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: simreplay [-repeats N] [-conf CONF]... TRACE...")
		os.Exit(2)
	}
	if len(cs) == 0 {
		cs = confs{"expandable_segments:False", "expandable_segments:True,stitch:False,expandable_map_unit_mb:2",
			"expandable_segments:True,stitch:False", ""}
	}
	fmt.Printf("cudapool on the simulator (80 GiB device, host time of this machine), %d passes per trace, GPU lag %d operations\n\n", *repeats, *lag)
	fmt.Printf("| trace | configuration | peak allocated GiB | peak reserved GiB | reserved/allocated | map calls | unmap calls | remaps | stitching misses | synchronizations | later remaps/pass | later map+unmap calls/pass | later synchronizations/pass | later mapping ms/pass on an H100 (estimate) | first pass ms | later ns/op |\n")
	fmt.Printf("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	status := 0
	for _, path := range flag.Args() {
		ops, slots, err := load(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, "simreplay:", err)
			os.Exit(1)
		}
		for _, c := range cs {
			r, err := replay(ops, slots, c, *repeats, *lag)
			if err != nil || r.failed > 0 {
				fmt.Fprintf(os.Stderr, "simreplay: %s with %q: %d failed allocations, %v\n", path, c, r.failed, err)
				status = 1
			}
			name := c
			if name == "" {
				name = "(default: stitching)"
			}
			fmt.Printf("| %s | %s | %.2f | %.2f | %.3f | %d | %d | %d | %d | %d | %.0f | %.0f | %.1f | %.1f | %.1f | %.0f |\n", path, name,
				float64(r.peakAlloc)/(1<<30), float64(r.peakRes)/(1<<30), float64(r.peakRes)/float64(max(r.peakAlloc, 1)),
				r.maps, r.unmaps, r.remaps, r.stitches, r.syncs, r.laterRemaps, r.laterCalls, r.laterSyncs, r.laterDriverMs,
				r.firstNs/1e6, r.laterNsPerOp)
		}
	}
	if *graph > 0 {
		fmt.Printf("\nOperations %d to %d of each trace captured into a CUDA graph's private pool\n\n", *graphFrom, *graphFrom+*graph)
		fmt.Printf("| trace | configuration | private pool MiB | map calls |\n|---|---|---:|---:|\n")
		for _, path := range flag.Args() {
			ops, slots, _ := load(path)
			for _, c := range cs {
				pb, calls, err := capture(ops, slots, c, *graphFrom, *graph)
				if err != nil {
					fmt.Fprintf(os.Stderr, "simreplay: %s with %q, captured: %v\n", path, c, err)
					status = 1
				}
				name := c
				if name == "" {
					name = "(default: stitching)"
				}
				fmt.Printf("| %s | %s | %.0f | %d |\n", path, name, float64(pb)/(1<<20), calls)
			}
		}
	}
	os.Exit(status)
}
