// SPDX-License-Identifier: Apache-2.0

package pools

// Statistics.
//
// Design. Stats is what torch.cuda.memory_stats() reports: for each of nine
// quantities a StatArray ("all", small pools, large pools) of four values
// (current, peak, sum of increases, sum of decreases). Kept in that shape, a
// cache-hit malloc+free pair updated 10 to 14 Stat entries spread over 7 of
// the 96-byte arrays, about 12 cache lines, the largest part of a pair's
// misses once the caller has evicted them (docs/hot-path.md, "Why it is
// built this way").
//
// So the seven quantities an allocation and a free change (allocation,
// allocated_bytes, active, active_bytes, requested_bytes, inactive_split,
// inactive_split_bytes) live in hotStats instead, in as few values as
// PyTorch's numbers can be derived from exactly:
//
//   - per pool, the current value, the sum of increases and the peak;
//   - for "all", the current value and the peak;
//   - nothing for the sums of decreases: since the last ResetAccumulated,
//     increases - decreases = current - (current at that reset), so
//     freed = allocated - current + base, base saved by the reset;
//   - nothing for "all"'s sums: every increase (decrease) of "all" is an
//     increase (decrease) of exactly one pool by the same amount, so they are
//     the pools' sums.
//
// Peaks stay exact: a peak is a maximum over every current value, not a
// function of the sums, so each increase still compares the new current
// value with its pool's peak and with "all"'s, as Stat.Increase does. The
// decreases touch the current values only.
//
// A pair of the small pool then touches the small pool's 192 bytes and
// "all"'s 128, adjacent and line-aligned (hotStats puts "all" between the
// pools): five lines instead of twelve, in no more instructions. Everything else (segments,
// reserved bytes, oversize counts, event counters) changes with segments or
// rare events and stays in ColdStats, in Stats' own shape. Cache.ReadStats
// assembles a Stats from both; it is the only way to read the seven
// quantities (Cache.Stats, a ColdStats, has no field for them, so a stale
// read does not compile).

// Stat is one statistic as PyTorch keeps it.
type Stat struct {
	Current   int64
	Peak      int64
	Allocated int64 // sum of all increases
	Freed     int64 // sum of all decreases
}

func (s *Stat) Increase(n int64) {
	s.Current += n
	s.Allocated += n
	if s.Current > s.Peak {
		s.Peak = s.Current
	}
}

func (s *Stat) Decrease(n int64) {
	s.Current -= n
	s.Freed += n
}

func (s *Stat) resetPeak()        { s.Peak = s.Current }
func (s *Stat) resetAccumulated() { s.Allocated, s.Freed = 0, 0 }

// The stat types of a StatArray.
const (
	StatAll   = 0
	StatSmall = 1
	StatLarge = 2
)

// StatArray is a statistic for all pools together, the small pools and the
// large pools.
type StatArray [3]Stat

// Increase adds n to the aggregate and to the small or large entry.
func (a *StatArray) Increase(small bool, n int64) {
	a[StatAll].Increase(n)
	a[poolStat(small)].Increase(n)
}

// Decrease subtracts n from the aggregate and the small or large entry.
func (a *StatArray) Decrease(small bool, n int64) {
	a[StatAll].Decrease(n)
	a[poolStat(small)].Decrease(n)
}

// Add changes by a signed amount.
func (a *StatArray) Add(small bool, n int64) {
	if n > 0 {
		a.Increase(small, n)
	} else if n < 0 {
		a.Decrease(small, -n)
	}
}

func poolStat(small bool) int {
	if small {
		return StatSmall
	}
	return StatLarge
}

// The quantities kept in hotStats, in the order of Stats.hotArrays.
const (
	hAllocation = iota
	hAllocatedBytes
	hActive
	hActiveBytes
	hRequestedBytes
	hInactiveSplit
	hInactiveSplitBytes
	nHot
)

// hotPool is one pool type's (small or large) share of the hot statistics.
// The arrays have nHotSlots entries so that an index masked with
// nHotSlots-1 needs no bounds check.
type hotPool struct {
	cur  [nHotSlots]int64
	inc  [nHotSlots]int64 // sums of increases since ResetAccumulated
	peak [nHotSlots]int64
}

const nHotSlots = 8 // nHot rounded up to a power of two

// hotStats are the per-allocation statistics (see the design note). Guarded,
// like the rest of the Cache, by the owner's lock. It is allocated on its
// own: Go aligns a 640-byte pointer-free object to 64 bytes, so the small
// pool and "all" (320 bytes) are exactly five lines, as are "all" and the
// large pool.
type hotStats struct {
	small hotPool
	all   struct{ cur, peak [nHotSlots]int64 }
	large hotPool
	// base is the pools' current values at the last ResetAccumulated
	// (freed = inc - (cur - base)); read only by ReadStats.
	base [2][nHotSlots]int64 // [0] small, [1] large
}

func (h *hotStats) pool(small bool) *hotPool {
	if small {
		return &h.small
	}
	return &h.large
}

// up adds n to *cur and raises *peak to the new value if it is higher.
func up(cur, peak *int64, n int64) {
	c := *cur + n
	*cur = c
	if c > *peak {
		*peak = c
	}
}

// increase adds n (> 0) to quantity q of the pool and of "all", raising
// their peaks.
func (h *hotStats) increase(small bool, q int, n int64) {
	q &= nHotSlots - 1
	p := h.pool(small)
	up(&p.cur[q], &p.peak[q], n)
	p.inc[q] += n
	up(&h.all.cur[q], &h.all.peak[q], n)
}

// allocated counts a new allocation of size bytes (requested asked for):
// allocation, allocated_bytes, active, active_bytes and requested_bytes go
// up, the pool looked up once and every index a constant (this runs on
// every malloc).
func (h *hotStats) allocated(small bool, size, requested int64) {
	p, a := h.pool(small), &h.all
	up(&p.cur[hAllocation], &p.peak[hAllocation], 1)
	up(&p.cur[hAllocatedBytes], &p.peak[hAllocatedBytes], size)
	up(&p.cur[hActive], &p.peak[hActive], 1)
	up(&p.cur[hActiveBytes], &p.peak[hActiveBytes], size)
	up(&p.cur[hRequestedBytes], &p.peak[hRequestedBytes], requested)
	p.inc[hAllocation]++
	p.inc[hAllocatedBytes] += size
	p.inc[hActive]++
	p.inc[hActiveBytes] += size
	p.inc[hRequestedBytes] += requested
	up(&a.cur[hAllocation], &a.peak[hAllocation], 1)
	up(&a.cur[hAllocatedBytes], &a.peak[hAllocatedBytes], size)
	up(&a.cur[hActive], &a.peak[hActive], 1)
	up(&a.cur[hActiveBytes], &a.peak[hActiveBytes], size)
	up(&a.cur[hRequestedBytes], &a.peak[hRequestedBytes], requested)
}

// released counts the user's free of a block of size bytes (Cache.Release,
// every free): allocation and allocated_bytes go down, the pool looked up
// once.
func (h *hotStats) released(small bool, size int64) {
	p, a := h.pool(small), &h.all
	p.cur[hAllocation]--
	p.cur[hAllocatedBytes] -= size
	a.cur[hAllocation]--
	a.cur[hAllocatedBytes] -= size
}

// returned counts a released block of size bytes (requested asked for) back
// in its pool (Cache.Return, every free): active, active_bytes and
// requested_bytes go down; with split, inactive_split and its bytes change
// by splitBlocks and splitBytes. The pool is looked up once.
func (h *hotStats) returned(small bool, size, requested int64, split bool, splitBlocks, splitBytes int64) {
	p, a := h.pool(small), &h.all
	if split {
		h.change(p, hInactiveSplit, splitBlocks)
		h.change(p, hInactiveSplitBytes, splitBytes)
	}
	p.cur[hActive]--
	p.cur[hActiveBytes] -= size
	p.cur[hRequestedBytes] -= requested
	a.cur[hActive]--
	a.cur[hActiveBytes] -= size
	a.cur[hRequestedBytes] -= requested
}

// change changes quantity q of the pool p (h.small or h.large) and of
// "all" by a signed amount, raising the peaks if it is an increase. Small
// enough to be inlined (Return's two calls per free).
func (h *hotStats) change(p *hotPool, q int, n int64) {
	q &= nHotSlots - 1
	p.cur[q] += n
	h.all.cur[q] += n
	if n > 0 {
		p.inc[q] += n
		p.peak[q] = max(p.peak[q], p.cur[q])
		h.all.peak[q] = max(h.all.peak[q], h.all.cur[q])
	}
}

// freed undoes allocated: the five quantities go down (a block the user
// freed that a front cache keeps for its next malloc, allocator/front.go).
func (h *hotStats) freed(small bool, size, requested int64) {
	h.released(small, size)
	h.returned(small, size, requested, false, 0, 0)
}

// cycled counts k frees of one block, each followed at once by its
// reallocation: the sums of increases grow by k allocations; the current
// values end where they were and the peaks cannot move (every value in
// between was lower).
func (h *hotStats) cycled(small bool, size, requested, k int64) {
	p := h.pool(small)
	p.inc[hAllocation] += k
	p.inc[hAllocatedBytes] += k * size
	p.inc[hActive] += k
	p.inc[hActiveBytes] += k * size
	p.inc[hRequestedBytes] += k * requested
}

// decrease subtracts n (> 0) from quantity q of the pool and of "all".
func (h *hotStats) decrease(small bool, q int, n int64) {
	q &= nHotSlots - 1
	h.pool(small).cur[q] -= n
	h.all.cur[q] -= n
}

// add changes quantity q by a signed amount.
func (h *hotStats) add(small bool, q int, n int64) { h.change(h.pool(small), q, n) }

func (h *hotStats) resetPeak() {
	for _, p := range [2]*hotPool{&h.small, &h.large} {
		p.peak = p.cur
	}
	h.all.peak = h.all.cur
}

func (h *hotStats) resetAccumulated() {
	for i, p := range [2]*hotPool{&h.small, &h.large} {
		p.inc = [nHotSlots]int64{}
		h.base[i] = p.cur
	}
}

// fill writes the seven hot quantities into st.
func (h *hotStats) fill(st *Stats) {
	for q, a := range st.hotArrays() {
		for i, p := range [2]*hotPool{&h.small, &h.large} {
			a[StatSmall+i] = Stat{Current: p.cur[q], Peak: p.peak[q], Allocated: p.inc[q],
				Freed: p.inc[q] - (p.cur[q] - h.base[i][q])}
		}
		a[StatAll] = Stat{Current: h.all.cur[q], Peak: h.all.peak[q],
			Allocated: a[StatSmall].Allocated + a[StatLarge].Allocated,
			Freed:     a[StatSmall].Freed + a[StatLarge].Freed}
	}
}

// ColdStats are the statistics that change only with segments and rare
// events, in Stats' shape; Cache.ReadStats adds the per-allocation ones.
type ColdStats struct {
	Segment       StatArray
	ReservedBytes StatArray

	OversizeAllocations Stat
	OversizeSegments    Stat

	NumAllocRetries   int64
	NumOOMs           int64
	NumSyncAllStreams int64
	NumDeviceAlloc    int64
	NumDeviceFree     int64
	MaxSplitSize      int64 // -1 when unlimited
}

func (s *ColdStats) resetPeak() {
	for t := range s.Segment {
		s.Segment[t].resetPeak()
		s.ReservedBytes[t].resetPeak()
	}
	s.OversizeAllocations.resetPeak()
	s.OversizeSegments.resetPeak()
}

func (s *ColdStats) resetAccumulated() {
	for t := range s.Segment {
		s.Segment[t].resetAccumulated()
		s.ReservedBytes[t].resetAccumulated()
	}
	s.OversizeAllocations.resetAccumulated()
	s.OversizeSegments.resetAccumulated()
	s.NumAllocRetries, s.NumOOMs, s.NumSyncAllStreams = 0, 0, 0
	s.NumDeviceAlloc, s.NumDeviceFree = 0, 0
}

// Stats are a device's statistics with the meaning of
// torch.cuda.memory_stats(): ColdStats and the per-allocation arrays.
type Stats struct {
	ColdStats

	Allocation         StatArray
	Active             StatArray
	InactiveSplit      StatArray
	AllocatedBytes     StatArray
	ActiveBytes        StatArray
	InactiveSplitBytes StatArray
	RequestedBytes     StatArray
}

var statTypeNames = [3]string{"all", "small_pool", "large_pool"}

// hotArrays are the arrays kept in hotStats, indexed by hAllocation...
func (s *Stats) hotArrays() [nHot]*StatArray {
	return [nHot]*StatArray{&s.Allocation, &s.AllocatedBytes, &s.Active, &s.ActiveBytes,
		&s.RequestedBytes, &s.InactiveSplit, &s.InactiveSplitBytes}
}

func (s *Stats) arrays() [9]struct {
	name string
	a    *StatArray
} {
	return [9]struct {
		name string
		a    *StatArray
	}{
		{"allocation", &s.Allocation}, {"segment", &s.Segment},
		{"active", &s.Active}, {"inactive_split", &s.InactiveSplit},
		{"allocated_bytes", &s.AllocatedBytes}, {"reserved_bytes", &s.ReservedBytes},
		{"active_bytes", &s.ActiveBytes}, {"inactive_split_bytes", &s.InactiveSplitBytes},
		{"requested_bytes", &s.RequestedBytes},
	}
}

// Each calls fn with every key of torch.cuda.memory_stats() (122 of them,
// in PyTorch's flattened "name.pool.metric" form) and its value.
func (s *Stats) Each(fn func(key string, v int64)) {
	stat := func(prefix string, st *Stat) {
		fn(prefix+".current", st.Current)
		fn(prefix+".peak", st.Peak)
		fn(prefix+".allocated", st.Allocated)
		fn(prefix+".freed", st.Freed)
	}
	for _, e := range s.arrays() {
		for t := range e.a {
			stat(e.name+"."+statTypeNames[t], &e.a[t])
		}
	}
	stat("oversize_allocations", &s.OversizeAllocations)
	stat("oversize_segments", &s.OversizeSegments)
	fn("num_alloc_retries", s.NumAllocRetries)
	fn("num_ooms", s.NumOOMs)
	fn("num_sync_all_streams", s.NumSyncAllStreams)
	fn("num_device_alloc", s.NumDeviceAlloc)
	fn("num_device_free", s.NumDeviceFree)
	fn("max_split_size", s.MaxSplitSize)
}

// ResetPeak sets every peak to its current value.
func (s *Stats) ResetPeak() {
	s.ColdStats.resetPeak()
	for _, a := range s.hotArrays() {
		for t := range a {
			a[t].resetPeak()
		}
	}
}

// ResetAccumulated zeroes the allocated/freed sums and the event counters.
func (s *Stats) ResetAccumulated() {
	s.ColdStats.resetAccumulated()
	for _, a := range s.hotArrays() {
		for t := range a {
			a[t].resetAccumulated()
		}
	}
}
