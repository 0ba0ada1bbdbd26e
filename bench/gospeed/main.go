// SPDX-License-Identifier: Apache-2.0

// Command gospeed measures the allocator package's own work on the
// simulator, one thread, no GPU: the free-set comparison and the hot-path
// breakdown of docs/hot-path.md.
//
//	go run ./bench/gospeed [-rounds 7]
//
// prints a table of the free sets side by side. Go's benchmarks report wall
// time, which on a shared machine measures the neighbours as much as the
// code. This measures the thread's CPU time (CLOCK_THREAD_CPUTIME_ID: time
// while descheduled does not count), repeats every configuration in
// interleaved rounds, and reports the median with the min-max. The cold rows
// time single pairs (wall clock, the clock's own cost subtracted) after
// touching other memory, as the Python interpreter does between two
// allocations, and report the median pair.
//
//	go build -o /tmp/gospeed ./bench/gospeed
//	valgrind --tool=cachegrind --cache-sim=yes /tmp/gospeed -cold 1000 [-nopair] [-conf CONF]
//
// -cold N runs N hot 4 KiB pairs, each after touching 2 MiB, and nothing
// else: for counting cache misses per pair under cachegrind (run again with
// -nopair, which only touches the memory, and subtract).
package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/bench/workload"
	"github.com/cudapool/cudapool/cuda/sim"
	"github.com/cudapool/cudapool/pools"
)

const giB = 1 << 30

func main() {
	rounds := flag.Int("rounds", 7, "interleaved rounds of every configuration")
	cold := flag.Int("cold", 0, "run this many cold pairs and nothing else (for cachegrind)")
	nopair := flag.Bool("nopair", false, "with -cold: touch the memory only, no pair")
	conf := flag.String("conf", "", "with -cold: the allocator's configuration")
	flag.Parse()
	var err error
	switch {
	case *cold > 0:
		err = coldPairs(*cold, *conf, !*nopair)
	case *rounds > 0:
		err = speed(*rounds)
	default:
		err = fmt.Errorf("-rounds must be positive")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gospeed:", err)
		os.Exit(1)
	}
}

// newAlloc is an allocator on one simulated device of mem bytes, told that
// every capture is announced (as the C++ class and CuPy do), so that a
// malloc does not ask the driver about capture.
func newAlloc(mem uint64, conf string) (*allocator.Allocator, error) {
	cfg, warnings, err := allocator.ParseConfig(conf)
	if err != nil {
		return nil, err
	}
	if len(warnings) > 0 { // a measurement of another configuration than asked for
		return nil, fmt.Errorf("configuration %q: %s", conf, strings.Join(warnings, "; "))
	}
	a, err := allocator.New(sim.New(sim.Options{Devices: 1, Memory: mem}), cfg)
	if err != nil {
		return nil, err
	}
	a.ExpectAnnouncements()
	return a, nil
}

// warmPair makes and frees one 4 KiB block: the segment the hot pairs reuse.
func warmPair(a *allocator.Allocator) error {
	p, err := a.Malloc(&allocator.MallocRequest{Size: 4096})
	if err != nil {
		return err
	}
	return a.Free(allocator.FreeRequest{Ptr: p})
}

func coldPairs(n int, conf string, pair bool) error {
	a, err := newAlloc(8*giB, conf)
	if err != nil {
		return err
	}
	if err := warmPair(a); err != nil {
		return err
	}
	evict := make([]byte, 2<<20)
	for i := 0; i < n; i++ {
		for j := 0; j < len(evict); j += 64 {
			evict[j]++
		}
		if pair {
			p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096})
			_ = a.Free(allocator.FreeRequest{Ptr: p})
		}
	}
	return nil
}

func threadCPU() int64 {
	var ts syscall.Timespec
	const clockThreadCPUTime = 3
	if _, _, e := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0); e != 0 {
		panic(e)
	}
	return ts.Nano()
}

// cpuPerOp runs fn n times and returns the thread CPU ns per call.
func cpuPerOp(n int, fn func()) float64 {
	t0 := threadCPU()
	for i := 0; i < n; i++ {
		fn()
	}
	return float64(threadCPU()-t0) / float64(n)
}

// coldPair returns the median wall time of one malloc+free after touching
// evict bytes of other memory, less the median cost of reading the clock.
func coldPair(a *allocator.Allocator, size uint64, evict []byte, n int) float64 {
	clock := make([]int64, n)
	pair := make([]int64, n)
	for i := 0; i < n; i++ {
		for j := 0; j < len(evict); j += 64 {
			evict[j]++
		}
		t0 := time.Now()
		t1 := time.Now()
		p, _ := a.Malloc(&allocator.MallocRequest{Size: size})
		_ = a.Free(allocator.FreeRequest{Ptr: p})
		t2 := time.Now()
		clock[i], pair[i] = int64(t1.Sub(t0)), int64(t2.Sub(t1))
	}
	return median64(pair) - median64(clock)
}

func median64(v []int64) float64 {
	s := append([]int64(nil), v...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return float64(s[len(s)/2])
}

func medianF(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func speed(rounds int) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	kinds := []pools.FreeSetKind{pools.FreeSetTreap, pools.FreeSetSegFit}
	rows := []string{"hot 4 KiB pair (CPU ns)", "mixed 512 B-144 MiB, 256 live (CPU ns)",
		"mixedPairs, 256 live (CPU ns)", "hot pair after 2 MiB touched (wall ns)", "hot pair after 8 MiB touched (wall ns)",
		"hot pair, one lock (queued free) (CPU ns)", "mixedPairs, the default: stitching (CPU ns)"}
	res := map[string]map[pools.FreeSetKind][]float64{}
	for _, r := range rows {
		res[r] = map[pools.FreeSetKind][]float64{}
	}
	evictS, evictL := make([]byte, 2<<20), make([]byte, 8<<20)
	for round := 0; round < rounds; round++ {
		for i := range kinds {
			k := kinds[(i+round)%len(kinds)] // alternate which goes first
			// Ordinary segments, named (the default is expandable segments
			// with stitching, the last row's).
			conf := "expandable_segments:False,free_set:" + k.String()
			a, err := newAlloc(140*giB, conf)
			if err != nil {
				return err
			}
			if err := warmPair(a); err != nil {
				return err
			}
			res[rows[0]][k] = append(res[rows[0]][k], cpuPerOp(300000, func() {
				p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096})
				_ = a.Free(allocator.FreeRequest{Ptr: p})
			}))
			res[rows[3]][k] = append(res[rows[3]][k], coldPair(a, 4096, evictS, 4000))
			res[rows[4]][k] = append(res[rows[4]][k], coldPair(a, 4096, evictL, 1000))
			// The C++ class's path: the previous pair's free rides with the
			// next malloc, one lock hold for both.
			var pend [1]allocator.FreeRequest
			var frees []allocator.FreeRequest
			res[rows[5]][k] = append(res[rows[5]][k], cpuPerOp(300000, func() {
				p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096, Frees: frees})
				pend[0] = allocator.FreeRequest{Dev: -1, Ptr: p}
				frees = pend[:]
			}))
			if err := a.Free(frees...); err != nil {
				return err
			}

			if a, err = newAlloc(140*giB, conf); err != nil {
				return err
			}
			w := workload.NewSlots(a)
			cpuPerOp(workload.SequenceLen, w.Step)
			res[rows[1]][k] = append(res[rows[1]][k], cpuPerOp(200000, w.Step))

			if a, err = newAlloc(80*giB, conf); err != nil {
				return err
			}
			m := workload.NewMixed(a, 256)
			m.Run(20000)
			res[rows[2]][k] = append(res[rows[2]][k], cpuPerOp(200000, func() { m.Run(1) }))

			if a, err = newAlloc(80*giB, "free_set:"+k.String()); err != nil {
				return err
			}
			m = workload.NewMixed(a, 256)
			m.Run(20000)
			res[rows[6]][k] = append(res[rows[6]][k], cpuPerOp(200000, func() { m.Run(1) }))
		}
	}
	out := fmt.Sprintf("allocator package, one thread, %d interleaved rounds: median (min-max)\n%-48s", rounds, "")
	for _, k := range kinds {
		out += fmt.Sprintf(" %24s", "free_set:"+k.String())
	}
	out += "\n"
	for _, r := range rows {
		out += fmt.Sprintf("%-48s", r)
		for _, k := range kinds {
			v := res[r][k]
			sort.Float64s(v)
			out += fmt.Sprintf(" %24s", fmt.Sprintf("%.0f (%.0f-%.0f)", medianF(v), v[0], v[len(v)-1]))
		}
		out += "\n"
	}
	fmt.Print(out)
	return nil
}
