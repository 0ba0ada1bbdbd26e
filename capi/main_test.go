// SPDX-License-Identifier: Apache-2.0

package main

import (
	"reflect"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/pools"
)

func env(kv ...string) func(string) (string, bool) {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestNewStateSim(t *testing.T) {
	st := newState(env("CUDAPOOL_BACKEND", "sim", "CUDAPOOL_SIM_DEVICES", "3", "CUDAPOOL_SIM_MEMORY", "2GiB",
		"PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64"))
	if st.err != nil {
		t.Fatal(st.err)
	}
	if st.sim == nil || st.a.DeviceCount() != 3 || st.sim.Capacity(2) != 2<<30 {
		t.Fatalf("sim backend not built as asked: %+v", st)
	}
	if got := st.a.Config().Pools.MaxSplitSize; got != 64<<20 {
		t.Errorf("PYTORCH_CUDA_ALLOC_CONF not applied: max split %d", got)
	}
}

func TestNewStateConfPrecedence(t *testing.T) {
	// CUDAPOOL_CONF wins even when set to the empty string.
	st := newState(env("CUDAPOOL_BACKEND", "sim", "CUDAPOOL_CONF", "", "PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64"))
	if st.err != nil {
		t.Fatal(st.err)
	}
	if got := st.a.Config().Pools.MaxSplitSize; got != pools.Unlimited {
		t.Errorf("CUDAPOOL_CONF=\"\" should win: max split %d", got)
	}
}

func TestNewStateErrors(t *testing.T) {
	for _, c := range []struct {
		env  []string
		want string
	}{
		{[]string{"CUDAPOOL_BACKEND", "gpu"}, `CUDAPOOL_BACKEND="gpu": expected cuda`},
		{[]string{"CUDAPOOL_BACKEND", "sim", "CUDAPOOL_SIM_DEVICES", "0"}, "CUDAPOOL_SIM_DEVICES"},
		{[]string{"CUDAPOOL_BACKEND", "sim", "CUDAPOOL_SIM_MEMORY", "12Q"}, "CUDAPOOL_SIM_MEMORY"},
	} {
		st := newState(env(c.env...))
		if st.err == nil || !strings.Contains(st.err.Error(), c.want) {
			t.Errorf("%v: error %v, want it to contain %q", c.env, st.err, c.want)
		}
		if st.err != nil && !strings.HasPrefix(st.err.Error(), "cudapool: ") {
			t.Errorf("%v: error %q lacks the cudapool: prefix", c.env, st.err)
		}
	}
}

// A configuration the environment gives that cudapool refuses is not fatal:
// the allocator gets the default configuration, and the error (naming the
// variable and the item, the item cut if long, the variable never echoed
// whole) is kept for the initializing call.
func TestNewStateBadConfiguration(t *testing.T) {
	long := "max_split_size_mb:x" + strings.Repeat("y", 120_000)
	for _, c := range []struct {
		env  []string
		want []string
	}{
		{[]string{"CUDAPOOL_CONF", "max_split_size_mb:x"}, []string{"CUDAPOOL_CONF: ", "max_split_size_mb=x: expected a non-negative integer", "default configuration"}},
		{[]string{"PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:1"}, []string{"PYTORCH_CUDA_ALLOC_CONF: ", "garbage_collection_threshold=1"}},
		{[]string{"CUDAPOOL_CONF", "Expandable_Segments:True"}, []string{`unknown key "Expandable_Segments"`, `did you mean "expandable_segments"?`}},
		{[]string{"CUDAPOOL_CONF", long}, []string{"... (120001 bytes)"}},
	} {
		st := newState(env(append([]string{"CUDAPOOL_BACKEND", "sim"}, c.env...)...))
		if st.err != nil || st.a == nil {
			t.Fatalf("%.60v: the state failed (%v); only the configuration was wrong", c.env, st.err)
		}
		if st.a.Config() != allocator.DefaultConfig() {
			t.Errorf("%.60v: configuration %q, want the default one", c.env, st.a.Config().String())
		}
		if st.confErr == nil {
			t.Fatalf("%.60v: no configuration error", c.env)
		}
		msg := errorText("cudapool_malloc", st.confErr)
		for _, w := range c.want {
			if !strings.Contains(msg, w) {
				t.Errorf("%.60v: error %.300q lacks %q", c.env, msg, w)
			}
		}
		if !strings.HasPrefix(msg, "cudapool_malloc: ") || len(msg) > 2000 {
			t.Errorf("%.60v: error of %d bytes: %.300q", c.env, len(msg), msg)
		}
	}
}

func TestParseBytes(t *testing.T) {
	for in, want := range map[string]uint64{
		"4096": 4096, "1K": 1 << 10, "2M": 2 << 20, "80G": 80 << 30, "80GiB": 80 << 30, "1TB": 1 << 40,
		" 3 g ": 3 << 30, "512B": 512, "1024": 1024,
	} {
		if got, err := parseBytes(in); err != nil || got != want {
			t.Errorf("parseBytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "x", "12Q", "-1", "1.5G", "G", "2000000T"} {
		if _, err := parseBytes(in); err == nil {
			t.Errorf("parseBytes(%q) succeeded", in)
		}
	}
}

func TestStatsJSON(t *testing.T) {
	var st pools.Stats
	st.Allocation[pools.StatAll].Increase(3)
	st.MaxSplitSize = -1
	js := string(statsJSON(&st))
	if n := strings.Count(js, `":`); n != 122 {
		t.Errorf("%d keys, want 122", n)
	}
	for _, want := range []string{`{"allocation.all.current":3,`, `"max_split_size":-1}`, `"requested_bytes.large_pool.freed":0`} {
		if !strings.Contains(js, want) {
			t.Errorf("stats JSON lacks %s: %s", want, js)
		}
	}
}

func TestGuardDisablesAfterPanic(t *testing.T) {
	old := current.Load()
	defer current.Store(old)
	current.Store(newState(env("CUDAPOOL_BACKEND", "sim")))
	if ready("test") == nil {
		t.Fatal("a fresh simulator state is not ready")
	}
	func() {
		defer guard("cudapool_malloc")
		panic("boom")
	}()
	st := current.Load()
	if st.err == nil || !strings.Contains(st.err.Error(), "cudapool_malloc: internal error (boom); cudapool is disabled") {
		t.Fatalf("after a panic: state error %v", st.err)
	}
	if ready("test") != nil {
		t.Error("ready() still returns an allocator after a panic")
	}
}

// cFront.SetPolicy hands the C front every field of Go's policy; devices
// past the ones it serves get no phases.
func TestFrontPolicyReachesC(t *testing.T) {
	prev := frontPolicy()
	defer cFront{}.SetPolicy(&prev)
	phases := make([]uint32, 20)
	for i := range phases {
		phases[i] = uint32(100 + i)
	}
	want := allocator.FrontPolicy{On: true, Hold: 17, ColdWindow: 3, ColdSkip: 5, ColdMaxShift: 7, Phases: phases}
	cFront{}.SetPolicy(&want)
	got := frontPolicy()
	want.Phases = phases[:16]
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("the C front's policy %+v, want %+v", got, want)
	}
	frontOff()
	if got := frontPolicy(); got.On || got.Hold != 0 || got.Phases[0] != 0 {
		t.Fatalf("after frontOff: %+v", got)
	}
}

// raiseProcs lifts GOMAXPROCS to minProcs, leaves a larger one alone, and
// never overrides a GOMAXPROCS the process was started with.
func TestRaiseProcs(t *testing.T) {
	cases := []struct {
		name      string
		env       []string
		have      int
		want, set int // set: the value passed to gomaxprocs, 0 if not called to change it
	}{
		{"one CPU", nil, 1, minProcs, minProcs},
		{"enough", nil, minProcs + 4, minProcs + 4, 0},
		{"set by the user", []string{"GOMAXPROCS", "1"}, 1, 1, 0},
	}
	for _, c := range cases {
		set := 0
		got := raiseProcs(env(c.env...), func(n int) int {
			if n > 0 {
				set = n
			}
			return c.have
		})
		if got != c.want || set != c.set {
			t.Errorf("%s: raiseProcs = %d (set %d), want %d (set %d)", c.name, got, set, c.want, c.set)
		}
	}
}
