// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo && amd64

package driver_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/ebitengine/purego"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/driver"
	"github.com/cudapool/cudapool/cuda/driver/internal/shimtest"
)

func nvmlInstalled() bool {
	h, err := purego.Dlopen("libnvidia-ml.so.1", purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return false
	}
	_ = purego.Dlclose(h)
	return true
}

// Without libnvidia-ml.so.1 every trampoline returns an NVML error instead of
// crashing, and DeviceProcesses reports that NVML is unavailable.
func TestNVMLWithoutLibrary(t *testing.T) {
	if nvmlInstalled() {
		t.Skip("libnvidia-ml.so.1 is installed here; TestNVMLFakeLibrary covers the trampolines")
	}
	if n, r := shimtest.DeviceCount(); r != int(nvml.ERROR_LIBRARY_NOT_FOUND) {
		t.Errorf("nvmlDeviceGetCount_v2 = %d, %d; want ERROR_LIBRARY_NOT_FOUND (12)", n, r)
	}
	if r := shimtest.Init(); r != int(nvml.ERROR_LIBRARY_NOT_FOUND) {
		t.Errorf("nvmlInit_v2 = %d", r)
	}
	if s := shimtest.ErrorString(0); !strings.Contains(s, "libnvidia-ml.so.1") {
		t.Errorf("nvmlErrorString = %q", s)
	}
	// go-nvml's own API, which skips nvml.Init here: reaches the stub too.
	if _, r := nvml.DeviceGetCount(); r != nvml.ERROR_LIBRARY_NOT_FOUND {
		t.Errorf("nvml.DeviceGetCount: %v", r)
	}

	_, err := driver.NVMLProcesses("0000:3b:00.0")
	if err == nil || !strings.Contains(err.Error(), "NVML is unavailable") {
		t.Fatalf("NVMLProcesses without NVML: %v", err)
	}
	t.Log(err)

	f := openFake(t)
	if _, err := f.DeviceProcesses(0); err == nil || !strings.Contains(err.Error(), "NVML is unavailable") {
		t.Fatalf("DeviceProcesses without NVML: %v", err)
	}
	if _, err := f.DeviceProcesses(7); err == nil {
		t.Fatal("DeviceProcesses(7) succeeded")
	}
}

// The trampolines with a (fake) NVML present, in a fresh process so that the
// first trampoline call takes the lazy path: the subprocess finds the fake
// libcuda.so.1 and libnvidia-ml.so.1 through LD_LIBRARY_PATH.
func TestNVMLFakeLibrary(t *testing.T) {
	dir := buildFakes(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperFakeNVML$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(),
		"CUDAPOOL_FAKE_NVML_HELPER=1",
		"LD_LIBRARY_PATH="+filepath.Join(dir, "ld"))
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestHelperFakeNVML") {
		t.Fatalf("helper process: %v\n%s", err, out)
	}
	t.Logf("helper process:\n%s", out)
}

func TestHelperFakeNVML(t *testing.T) {
	if os.Getenv("CUDAPOOL_FAKE_NVML_HELPER") == "" {
		t.Skip("run by TestNVMLFakeLibrary")
	}
	// First trampoline call of the process: it goes through cp_nvml_lazy,
	// which must carry 6 integer, 8 floating-point and 2 stack arguments
	// across the resolution.
	if r := shimtest.ManyArgs(); r != 0 {
		t.Fatalf("arguments corrupted through the lazy resolver: fake returned %d", r)
	}
	// Functions the fake library lacks: the "function not found" stubs.
	if _, r := shimtest.DeviceCount(); r != int(nvml.ERROR_FUNCTION_NOT_FOUND) {
		t.Errorf("missing nvmlDeviceGetCount_v2 = %d, want 13", r)
	}
	if s := shimtest.ErrorString(0); s != "function not found in the NVML library" {
		t.Errorf("missing nvmlErrorString = %q", s)
	}

	d, err := driver.Open() // the fake libcuda.so.1
	if err != nil {
		t.Fatal(err)
	}
	procs, err := d.DeviceProcesses(0)
	if err != nil {
		t.Fatal(err)
	}
	want := []cuda.ProcessMemory{{PID: 111, Bytes: 1 << 30}, {PID: 222, Bytes: 0}}
	if !reflect.DeepEqual(procs, want) {
		t.Fatalf("DeviceProcesses(0) = %v, want %v", procs, want)
	}
	if _, err := d.DeviceProcesses(1); err == nil || !strings.Contains(err.Error(), "0000:3c:00.0") {
		t.Fatalf("DeviceProcesses(1) on a bus id NVML does not know: %v", err)
	} else {
		t.Log(err)
	}
}
