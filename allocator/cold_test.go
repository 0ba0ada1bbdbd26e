package allocator_test

import (
	"os"
	"strconv"
	"testing"

	"github.com/cudapool/cudapool/allocator"
)

// TestColdPairs runs CUDAPOOL_COLD pairs, each after touching 2 MiB, for
// counting cache misses per pair under valgrind --tool=cachegrind (run
// again with CUDAPOOL_COLD_NOPAIR=1 and subtract). Skipped otherwise.
func TestColdPairs(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("CUDAPOOL_COLD"))
	if n <= 0 {
		t.Skip("set CUDAPOOL_COLD=N to run N cold pairs (for cachegrind)")
	}
	a, _ := newAlloc(t, 1, 8*GiB, os.Getenv("CUDAPOOL_COLD_CONF"))
	a.ExpectAnnouncements()
	p := mustMalloc(t, a, 0, 4096, 0)
	_ = a.Free(allocator.FreeRequest{Ptr: p})
	evict := make([]byte, 2<<20)
	pair := os.Getenv("CUDAPOOL_COLD_NOPAIR") != "1"
	for i := 0; i < n; i++ {
		for j := 0; j < len(evict); j += 64 {
			evict[j]++
		}
		if pair {
			p, _ := a.Malloc(&allocator.MallocRequest{Size: 4096})
			_ = a.Free(allocator.FreeRequest{Ptr: p})
		}
	}
}
