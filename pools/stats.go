package pools

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

// Stats are a device's statistics with the meaning of
// torch.cuda.memory_stats().
type Stats struct {
	Allocation         StatArray
	Segment            StatArray
	Active             StatArray
	InactiveSplit      StatArray
	AllocatedBytes     StatArray
	ReservedBytes      StatArray
	ActiveBytes        StatArray
	InactiveSplitBytes StatArray
	RequestedBytes     StatArray

	OversizeAllocations Stat
	OversizeSegments    Stat

	NumAllocRetries   int64
	NumOOMs           int64
	NumSyncAllStreams int64
	NumDeviceAlloc    int64
	NumDeviceFree     int64
	MaxSplitSize      int64 // -1 when unlimited
}

var statTypeNames = [3]string{"all", "small_pool", "large_pool"}

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
	for _, e := range s.arrays() {
		for t := range e.a {
			e.a[t].resetPeak()
		}
	}
	s.OversizeAllocations.resetPeak()
	s.OversizeSegments.resetPeak()
}

// ResetAccumulated zeroes the allocated/freed sums and the event counters.
func (s *Stats) ResetAccumulated() {
	for _, e := range s.arrays() {
		for t := range e.a {
			e.a[t].resetAccumulated()
		}
	}
	s.OversizeAllocations.resetAccumulated()
	s.OversizeSegments.resetAccumulated()
	s.NumAllocRetries, s.NumOOMs, s.NumSyncAllStreams = 0, 0, 0
	s.NumDeviceAlloc, s.NumDeviceFree = 0, 0
}
