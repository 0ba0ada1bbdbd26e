// SPDX-License-Identifier: Apache-2.0

package allocator

import (
	"fmt"
	"math/bits"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/cudapool/cudapool/pools"
)

// Config is the allocator's configuration, written in PyTorch's
// PYTORCH_CUDA_ALLOC_CONF syntax: comma-separated key:value pairs.
type Config struct {
	Pools pools.Config
	// ExpandableSegments grows each pool's memory by mapping pages into one
	// reserved address range per stream instead of allocating segments
	// (package vmem). On by default, with stitching (stitch:False keeps it
	// without); expandable_segments:False gives ordinary segments and turns
	// stitching off too, and with a named stitch:True is an error. Without
	// the driver's virtual memory management API it falls back to ordinary
	// segments: quietly by default, with a note where the configuration
	// named expandable_segments:True or stitch:True.
	ExpandableSegments bool
	// ExpandableMapUnit is the least that growth maps at once in the large
	// pools of expandable segments, in bytes (a multiple of 2 MiB).
	// cudapool's own key: expandable_map_unit_mb (default 20, PyTorch's
	// large-pool page; 2 maps page by page). See vmem/space.go.
	ExpandableMapUnit uint64
	// Stitch moves free physical pages of expandable segments to where a
	// miss needs them before mapping new memory (vmem/stitch.go). It implies
	// expandable segments. cudapool's own key: stitch. On by default:
	// unless the configuration names it, it follows ExpandableSegments (on
	// by default, off with expandable_segments:False; see resolveStitch).
	Stitch bool
	// NoStitchSync keeps stitching from synchronizing the device to take
	// other streams' idle pages (vmem/stitch.go, "Synchronizing"):
	// cudapool's key stitch_sync:False.
	NoStitchSync bool
	// StitchChunk is the size of the physical allocations of the default
	// large pool's ranges with stitching, the unit its pages move in, in
	// bytes (a multiple of 2 MiB): cudapool's key stitch_chunk_mb (default
	// 2, one page). Larger chunks cost fewer driver calls per byte moved
	// and move only within the large pool (vmem/stitch.go, "Chunks").
	StitchChunk uint64
	// ExpandableSet and StitchSet record that the configuration named
	// expandable_segments or stitch, rather than taking the default (a
	// run-time update keeps what earlier configurations named): see
	// resolveStitch.
	ExpandableSet, StitchSet bool
	// ReleaseLockOnMalloc is accepted for compatibility; cudapool keeps the
	// device lock across the driver allocation.
	ReleaseLockOnMalloc bool
	// HistoryEntries bounds the per-device trace of allocator actions kept
	// for snapshots (0: no trace). cudapool's own key: record_history. A
	// value > 0 turns the memory history on without contexts (level
	// never); Allocator.RecordHistory asks for more (history.go).
	HistoryEntries int
	// DebugChecks verifies every invariant after each operation (slow).
	// cudapool's own key: debug_checks.
	DebugChecks bool
	// MemoryFraction, when MemoryFractionSet, is every device's memory
	// fraction (PyTorch 2.11's per_process_memory_fraction), applied when
	// the allocator is made and on Configure; SetMemoryFraction overrides
	// it per device. In [0, 1]; 1 is no limit.
	MemoryFraction    float64
	MemoryFractionSet bool
	// GraphCaptureRecordStreamReuse lets a block freed during a capture
	// while other streams use it be reused in the same capture once the
	// capture graph orders all its uses before the allocating stream's new
	// work (PyTorch's graph_capture_record_stream_reuse; graphs/reuse.go).
	GraphCaptureRecordStreamReuse bool
	// FrontCache lets a front cache (capi's C front, front.go) serve a
	// malloc with a block of the same size and stream freed since the last
	// call into the allocator, without entering Go. cudapool's own key:
	// front_cache (default True; False for comparisons).
	FrontCache bool
	// WarmRuntime keeps the library's Go runtime ready for calls from C
	// while they come (capi/warm: a goroutine napping in a system call, so
	// that sysmon does not sleep deeply; it parks after a second without
	// calls). Not used by the allocator itself; capi applies it. cudapool's
	// own key: warm_runtime (default True).
	WarmRuntime bool
}

// DefaultConfig is PyTorch's default configuration, with cudapool's own
// defaults: expandable segments with stitching (less memory reserved for
// the same allocations: docs/fragmentation.md), the front cache and the
// warm runtime on.
func DefaultConfig() Config {
	return Config{Pools: pools.DefaultConfig(), ExpandableSegments: true, Stitch: true,
		ExpandableMapUnit: DefaultMapUnit, StitchChunk: DefaultStitchChunk, FrontCache: true, WarmRuntime: true}
}

// DefaultMapUnit is expandable_map_unit_mb's default, in bytes.
const DefaultMapUnit = 20 << 20

// DefaultStitchChunk is stitch_chunk_mb's default, in bytes: one page.
const DefaultStitchChunk = 2 << 20

// ParseConfig parses a PYTORCH_CUDA_ALLOC_CONF string on top of the
// defaults. A key that neither cudapool nor PyTorch knows is an error that
// names the key and lists the known ones (keys are case-sensitive, as in
// PyTorch); PyTorch keys that have no effect in cudapool are accepted, some
// with a note in warnings for the caller to report. User text quoted in an
// error is cut to a readable length (see quote).
func ParseConfig(s string) (cfg Config, warnings []string, err error) {
	return parseOnto(DefaultConfig(), s)
}

// parseOnto applies the keys of s to cfg, then resolves stitch against
// expandable_segments (resolveStitch).
func parseOnto(cfg Config, s string) (Config, []string, error) {
	var warnings []string
	// Which of stitch and expandable_segments s names, for resolveStitch.
	earlier := cfg
	cfg.StitchSet, cfg.ExpandableSet = false, false
	for _, item := range splitTop(s) {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		key, val, ok := strings.Cut(item, ":")
		key, val = strings.TrimSpace(key), strings.TrimSpace(val)
		if !ok || val == "" {
			return cfg, warnings, configError("%s: expected key:value", quote(item))
		}
		w, err := cfg.set(key, val)
		if err != nil {
			return cfg, warnings, err
		}
		if w != "" {
			warnings = append(warnings, w)
		}
	}
	err := cfg.resolveStitch(earlier)
	return cfg, warnings, err
}

// resolveStitch settles stitch and expandable_segments once every key of a
// configuration string is applied, so that the order of the keys never
// matters. c.StitchSet and c.ExpandableSet say which of the two the string
// named; earlier is the configuration it was applied to (the defaults, or
// for a run-time update the configuration in force, whose named keys still
// count as named: the pair in force after an update is judged as one
// configuration). On return the Set fields cover both.
//
//   - stitch:True with expandable_segments:False, both named (in the string,
//     or one in it and the other earlier), is an error: stitching moves the
//     pages of expandable segments, and choosing one by key order or by
//     call order would be a silent guess.
//   - A stitch never named follows expandable_segments: on with it (the
//     default), off with expandable_segments:False (ordinary segments).
//   - A named stitch:True implies expandable segments.
func (c *Config) resolveStitch(earlier Config) error {
	namedStitch, namedExp := c.StitchSet, c.ExpandableSet
	c.StitchSet = namedStitch || earlier.StitchSet
	c.ExpandableSet = namedExp || earlier.ExpandableSet
	if c.StitchSet && c.Stitch && c.ExpandableSet && !c.ExpandableSegments {
		where := ""
		if !namedStitch {
			where = " (stitch:True is in force from an earlier configuration)"
		} else if !namedExp {
			where = " (expandable_segments:False is in force from an earlier configuration)"
		}
		return configError("stitch:True and expandable_segments:False contradict each other%s: stitching moves the pages "+
			"of expandable segments. Keep one: expandable_segments:False alone turns stitching off too, "+
			"stitch:False keeps expandable segments without stitching", where)
	}
	if !c.StitchSet {
		c.Stitch = c.ExpandableSegments
	}
	if c.Stitch {
		c.ExpandableSegments = true
	}
	return nil
}

// splitTop splits on commas outside brackets.
func splitTop(s string) []string {
	var out []string
	depth, start := 0, 0
	for i, r := range s {
		switch r {
		case '[':
			depth++
		case ']':
			depth--
		case ',':
			if depth == 0 {
				out = append(out, s[start:i])
				start = i + 1
			}
		}
	}
	return append(out, s[start:])
}

func configError(format string, args ...any) error {
	return &Error{Op: "configure", Kind: ErrInvalidConfig, Msg: fmt.Sprintf(format, args...)}
}

// maxShown is how much of a piece of user text an error quotes: enough to
// recognize it, short enough that a mistaken 100 KB string (a file pasted
// into the variable) does not flood the terminal.
const maxShown = 200

// clip returns s, or its first maxShown bytes (whole characters) followed
// by "... (N bytes)".
func clip(s string) string {
	if len(s) <= maxShown {
		return s
	}
	n := maxShown
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return fmt.Sprintf("%s... (%d bytes)", s[:n], len(s))
}

// quote is clip in Go's quoted form (control characters escaped).
func quote(s string) string {
	if len(s) <= maxShown {
		return strconv.Quote(s)
	}
	c := clip(s)
	i := strings.LastIndex(c, "... (")
	return strconv.Quote(c[:i]) + c[i:]
}

// The keys ParseConfig knows, for the error that names an unknown one.
// PyTorch's are those of PyTorch 2.11's AcceleratorAllocatorConfig and
// CUDAAllocatorConfig (c10/core/AllocatorConfig.h, c10/cuda/
// CUDAAllocatorConfig.h), with the ROCm spellings its CUDA builds accept
// too; set handles each of them, and each of cudapool's own.
var (
	pytorchKeys = []string{
		"backend", "expandable_segments", "expandable_segments_reserve", "expandable_segments_reserve_by_class",
		"garbage_collection_threshold", "graph_capture_record_stream_reuse", "large_segment_size_mb",
		"max_non_split_rounding_mb", "max_split_size_mb", "per_process_memory_fraction",
		"pinned_free_catch_all", "pinned_num_register_threads", "pinned_reserve_segment_size_mb",
		"pinned_use_background_threads", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
		"release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "roundup_power2_divisions",
		"throw_on_cudamalloc_oom",
	}
	cudapoolKeys = []string{
		"debug_checks", "expandable_map_unit_mb", "free_set", "front_cache", "record_history", "stitch", "stitch_chunk_mb",
		"stitch_sync", "warm_runtime",
	}
)

// unknownKey is the error for a key set does not handle.
func unknownKey(key string) error {
	hint := ""
	for _, k := range append(append([]string(nil), pytorchKeys...), cudapoolKeys...) {
		if strings.EqualFold(k, key) {
			hint = fmt.Sprintf(" (keys are case-sensitive: did you mean %q?)", k)
			break
		}
	}
	return configError("unknown key %s%s; the known keys are PyTorch's %s and cudapool's own %s",
		quote(key), hint, strings.Join(pytorchKeys, ", "), strings.Join(cudapoolKeys, ", "))
}

func (c *Config) set(key, val string) (warning string, err error) {
	const mb = 1 << 20
	switch key {
	case "max_split_size_mb":
		n, err := parseUint(key, val)
		if err != nil {
			return "", err
		}
		if n < pools.LargeBuffer/mb {
			return "", configError("max_split_size_mb=%d is too small: it must be at least %d", n, pools.LargeBuffer/mb)
		}
		c.Pools.MaxSplitSize = pools.Unlimited
		if n < pools.Unlimited/mb {
			c.Pools.MaxSplitSize = n * mb
		}
	case "max_non_split_rounding_mb":
		n, err := parseUint(key, val)
		if err != nil {
			return "", err
		}
		c.Pools.MaxNonSplitRounding = n * mb
	case "large_segment_size_mb":
		n, err := parseUint(key, val)
		if err != nil {
			return "", err
		}
		if n == 0 || n%2 != 0 {
			return "", configError("large_segment_size_mb=%d: it must be a positive multiple of 2", n)
		}
		c.Pools.LargeSegmentSize = n * mb
	case "roundup_power2_divisions":
		return "", c.parseRoundup(val)
	case "garbage_collection_threshold":
		t, err := strconv.ParseFloat(val, 64)
		if err != nil || !(t > 0 && t < 1) {
			return "", configError("garbage_collection_threshold=%s: it must be a number strictly between 0 and 1", clip(val))
		}
		c.Pools.GCThreshold = t
	case "expandable_segments":
		b, err := parseBool(key, val)
		if err != nil {
			return "", err
		}
		c.ExpandableSegments, c.ExpandableSet = b, true
	case "expandable_map_unit_mb":
		n, err := parseUint(key, val)
		if err != nil {
			return "", err
		}
		if n == 0 || n%2 != 0 || n > 1<<20 {
			return "", configError("expandable_map_unit_mb=%d: it must be a positive multiple of 2 (MiB), at most %d", n, 1<<20)
		}
		c.ExpandableMapUnit = n * mb
	case "stitch":
		b, err := parseBool(key, val)
		if err != nil {
			return "", err
		}
		// Its relation to expandable_segments is settled once the whole
		// string is applied (resolveStitch).
		c.Stitch, c.StitchSet = b, true
	case "stitch_sync":
		b, err := parseBool(key, val)
		if err != nil {
			return "", err
		}
		c.NoStitchSync = !b
	case "stitch_chunk_mb":
		n, err := parseUint(key, val)
		if err != nil {
			return "", err
		}
		if n == 0 || n%2 != 0 || n > 1024 {
			return "", configError("stitch_chunk_mb=%d: it must be a positive multiple of 2 (MiB), at most 1024", n)
		}
		c.StitchChunk = n * mb
	case "release_lock_on_cudamalloc", "release_lock_on_hipmalloc":
		b, err := parseBool(key, val)
		if err != nil {
			return "", err
		}
		c.ReleaseLockOnMalloc = b
		if b {
			return key + ":True has no effect in cudapool: the device lock is held across cuMemAlloc", nil
		}
	case "backend":
		if val != "native" {
			return "", configError("backend=%s: cudapool is itself the allocator; only backend:native makes sense here", clip(val))
		}
	case "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_use_background_threads", "pinned_free_catch_all":
		// Host (pinned) memory options: PyTorch's host allocator reads
		// them itself; not this allocator's business.
		if _, err := parseBool(key, val); err != nil {
			return "", err
		}
	case "pinned_num_register_threads", "pinned_reserve_segment_size_mb":
		if _, err := parseUint(key, val); err != nil {
			return "", err
		}
	case "throw_on_cudamalloc_oom":
		b, err := parseBool(key, val)
		if err != nil {
			return "", err
		}
		if b {
			return "throw_on_cudamalloc_oom:True has no effect in cudapool: an allocation fails only after the driver refused it", nil
		}
	case "expandable_segments_reserve", "expandable_segments_reserve_by_class":
		// cudapool sizes the address range of an expandable segment itself
		// (vmem/space.go, "Reservation sizes").
		return key + " has no effect in cudapool: it sizes the address ranges of expandable segments itself", nil
	case "per_process_memory_fraction":
		f, err := strconv.ParseFloat(val, 64)
		if err != nil {
			return "", configError("per_process_memory_fraction=%s: expected a number", clip(val))
		}
		if !(f >= 0 && f <= 1) {
			return "", configError("per_process_memory_fraction is invalid, set it in [0.0, 1.0] (got %s)", clip(val))
		}
		c.MemoryFraction, c.MemoryFractionSet = f, true
	case "graph_capture_record_stream_reuse":
		b, err := parseBool(key, val)
		if err != nil {
			return "", err
		}
		c.GraphCaptureRecordStreamReuse = b
	case "record_history":
		n, err := parseUint(key, val)
		if err != nil {
			return "", err
		}
		if n > 1<<24 {
			return "", configError("record_history=%d: at most %d entries", n, 1<<24)
		}
		c.HistoryEntries = int(n)
	case "front_cache":
		b, err := parseBool(key, val)
		if err != nil {
			return "", err
		}
		c.FrontCache = b
	case "warm_runtime":
		b, err := parseBool(key, val)
		if err != nil {
			return "", err
		}
		c.WarmRuntime = b
	case "debug_checks":
		b, err := parseBool(key, val)
		if err != nil {
			return "", err
		}
		c.DebugChecks = b
	case "free_set":
		switch val {
		case "treap":
			c.Pools.FreeSet = pools.FreeSetTreap
		case "sorted":
			c.Pools.FreeSet = pools.FreeSetSorted
		case "segfit":
			c.Pools.FreeSet = pools.FreeSetSegFit
		default:
			return "", configError("free_set=%s: expected segfit, treap or sorted", clip(val))
		}
	default:
		return "", unknownKey(key)
	}
	return "", nil
}

// parseRoundup reads "N" (every size) or "[64:8,256:4,>:1]" (per interval,
// keys in MiB and powers of two), with PyTorch's semantics: the first key
// also covers every interval below it, ">" every interval from the last key.
func (c *Config) parseRoundup(val string) error {
	d := &c.Pools.RoundupDivisions
	check := func(n uint64) error {
		if n != 0 && n&(n-1) != 0 {
			return configError("roundup_power2_divisions: %d divisions; it must be a power of 2, or 0 to disable", n)
		}
		return nil
	}
	if !strings.HasPrefix(val, "[") {
		n, err := parseUint("roundup_power2_divisions", val)
		if err != nil {
			return err
		}
		if err := check(n); err != nil {
			return err
		}
		for i := range d {
			d[i] = n
		}
		return nil
	}
	if !strings.HasSuffix(val, "]") {
		return configError("roundup_power2_divisions=%s: missing ]", val)
	}
	first, last := true, 0
	for _, e := range strings.Split(val[1:len(val)-1], ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(e), ":")
		if !ok {
			return configError("roundup_power2_divisions: %s: expected size_mb:divisions", quote(e))
		}
		n, err := parseUint("roundup_power2_divisions", strings.TrimSpace(v))
		if err != nil {
			return err
		}
		if err := check(n); err != nil {
			return err
		}
		if strings.TrimSpace(k) == ">" {
			for i := last; i < len(d); i++ {
				d[i] = n
			}
			continue
		}
		size, err := parseUint("roundup_power2_divisions", strings.TrimSpace(k))
		if err != nil {
			return err
		}
		if size == 0 || size&(size-1) != 0 {
			return configError("roundup_power2_divisions: interval %d MiB; it must be a power of 2", size)
		}
		i := min(bits.Len64(size)-1, len(d)-1)
		if first {
			for j := 0; j < i; j++ {
				d[j] = n
			}
			first = false
		}
		d[i] = n
		last = i
	}
	return nil
}

func parseUint(key, val string) (uint64, error) {
	n, err := strconv.ParseUint(val, 10, 64)
	if err != nil {
		return 0, configError("%s=%s: expected a non-negative integer", key, clip(val))
	}
	return n, nil
}

func parseBool(key, val string) (bool, error) {
	switch val {
	case "True", "true", "1":
		return true, nil
	case "False", "false", "0":
		return false, nil
	}
	return false, configError("%s=%s: expected True or False", key, clip(val))
}

// String renders the configuration in the same syntax.
func (c Config) String() string {
	p := c.Pools
	var parts []string
	if p.MaxSplitSize != pools.Unlimited {
		parts = append(parts, fmt.Sprintf("max_split_size_mb:%d", p.MaxSplitSize>>20))
	}
	if p.MaxNonSplitRounding != pools.LargeBuffer {
		parts = append(parts, fmt.Sprintf("max_non_split_rounding_mb:%d", p.MaxNonSplitRounding>>20))
	}
	if p.LargeSegmentSize != pools.LargeBuffer {
		parts = append(parts, fmt.Sprintf("large_segment_size_mb:%d", p.LargeSegmentSize>>20))
	}
	if p.RoundupDivisions != ([16]uint64{}) {
		var ds []string
		for i, n := range p.RoundupDivisions {
			ds = append(ds, fmt.Sprintf("%d:%d", uint64(1)<<i, n))
		}
		parts = append(parts, "roundup_power2_divisions:["+strings.Join(ds, ",")+"]")
	}
	if p.GCThreshold > 0 {
		parts = append(parts, fmt.Sprintf("garbage_collection_threshold:%g", p.GCThreshold))
	}
	// The two keys appear where they were named (so that the string parses
	// back to the same configuration) or differ from the defaults
	// (expandable segments on; stitch follows expandable_segments).
	if c.ExpandableSet || !c.ExpandableSegments {
		parts = append(parts, "expandable_segments:"+pyBool(c.ExpandableSegments))
	}
	if c.ExpandableMapUnit != DefaultMapUnit {
		parts = append(parts, fmt.Sprintf("expandable_map_unit_mb:%d", c.ExpandableMapUnit>>20))
	}
	if c.StitchSet || c.Stitch != c.ExpandableSegments {
		parts = append(parts, "stitch:"+pyBool(c.Stitch))
	}
	if c.NoStitchSync {
		parts = append(parts, "stitch_sync:False")
	}
	if c.StitchChunk != DefaultStitchChunk {
		parts = append(parts, fmt.Sprintf("stitch_chunk_mb:%d", c.StitchChunk>>20))
	}
	if c.MemoryFractionSet {
		parts = append(parts, fmt.Sprintf("per_process_memory_fraction:%g", c.MemoryFraction))
	}
	if c.HistoryEntries > 0 {
		parts = append(parts, fmt.Sprintf("record_history:%d", c.HistoryEntries))
	}
	if p.FreeSet != pools.DefaultFreeSet {
		parts = append(parts, "free_set:"+p.FreeSet.String())
	}
	if c.GraphCaptureRecordStreamReuse {
		parts = append(parts, "graph_capture_record_stream_reuse:True")
	}
	if c.DebugChecks {
		parts = append(parts, "debug_checks:True")
	}
	if !c.FrontCache {
		parts = append(parts, "front_cache:False")
	}
	if !c.WarmRuntime {
		parts = append(parts, "warm_runtime:False")
	}
	return strings.Join(parts, ",")
}

// pyBool is b as PyTorch's configuration strings write it.
func pyBool(b bool) string {
	if b {
		return "True"
	}
	return "False"
}
