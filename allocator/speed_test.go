package allocator_test

// The free-set comparison and the hot-path breakdown (docs/hot-path.md), as
// a test that prints a table; it runs only with CUDAPOOL_SPEED=1:
//
//	CUDAPOOL_SPEED=1 go test ./allocator -run TestSpeed -v -count=1
//
// Go's benchmarks report wall time, which on a shared machine measures the
// neighbours as much as the code. This measures the thread's CPU time
// (CLOCK_THREAD_CPUTIME_ID: time while descheduled does not count), repeats
// every configuration in interleaved rounds, and reports the median with the
// min-max. The cold rows time single pairs (wall clock, the clock's own cost
// subtracted) after touching other memory, as the Python interpreter does
// between two allocations, and report the median pair.

import (
	"fmt"
	"os"
	"runtime"
	"sort"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/pools"
	"github.com/stretchr/testify/require"
)

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

var sink byte

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
	sink += evict[0]
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

func TestSpeed(t *testing.T) {
	if os.Getenv("CUDAPOOL_SPEED") != "1" {
		t.Skip("set CUDAPOOL_SPEED=1 to measure (prints a table; asserts nothing about speed)")
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	rounds := 7
	if r, err := strconv.Atoi(os.Getenv("CUDAPOOL_SPEED_ROUNDS")); err == nil && r > 0 {
		rounds = r
	}
	kinds := []pools.FreeSetKind{pools.FreeSetTreap, pools.FreeSetSegFit}
	rows := []string{"hot 4 KiB pair (CPU ns)", "mixed 512 B-144 MiB, 256 live (CPU ns)",
		"mixedPairs, 256 live (CPU ns)", "hot pair after 2 MiB touched (wall ns)", "hot pair after 8 MiB touched (wall ns)",
		"hot pair, one lock (queued free) (CPU ns)", "mixedPairs, expandable segments (CPU ns)"}
	res := map[string]map[pools.FreeSetKind][]float64{}
	for _, r := range rows {
		res[r] = map[pools.FreeSetKind][]float64{}
	}
	evictS, evictL := make([]byte, 2<<20), make([]byte, 8<<20)
	for round := 0; round < rounds; round++ {
		for i := range kinds {
			k := kinds[(i+round)%len(kinds)] // alternate which goes first
			conf := "free_set:" + k.String()
			a, _ := newAlloc(t, 1, 140*GiB, conf)
			a.ExpectAnnouncements()
			p := mustMalloc(t, a, 0, 4096, 0)
			require.NoError(t, a.Free(allocator.FreeRequest{Ptr: p}))
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
				r := &allocator.MallocRequest{Size: 4096, Frees: frees}
				p, _ := a.Malloc(r)
				pend[0] = allocator.FreeRequest{Dev: -1, Ptr: p}
				frees = pend[:]
			}))
			require.NoError(t, a.Free(frees...))

			a, _ = newAlloc(t, 1, 140*GiB, conf)
			a.ExpectAnnouncements()
			sizes, slots := benchSequence()
			live := make([]cuda.Ptr, 256)
			j := 0
			step := func() {
				x := j & 65535
				if p := live[slots[x]]; p != 0 {
					_ = a.Free(allocator.FreeRequest{Ptr: p})
				}
				live[slots[x]], _ = a.Malloc(&allocator.MallocRequest{Size: sizes[x]})
				j++
			}
			cpuPerOp(65536, step)
			res[rows[1]][k] = append(res[rows[1]][k], cpuPerOp(200000, step))

			a, _ = newAlloc(t, 1, 80*GiB, conf)
			a.ExpectAnnouncements()
			m := newMixed(a, 256)
			m.run(20000)
			res[rows[2]][k] = append(res[rows[2]][k], cpuPerOp(200000, func() { m.run(1) }))

			a, _ = newAlloc(t, 1, 80*GiB, conf+",expandable_segments:True")
			a.ExpectAnnouncements()
			m = newMixed(a, 256)
			m.run(20000)
			res[rows[6]][k] = append(res[rows[6]][k], cpuPerOp(200000, func() { m.run(1) }))
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
}
