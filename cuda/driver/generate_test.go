// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo && amd64

package driver_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/cuda/driver/internal/nvmlsyms"
)

// The trampoline file must cover exactly the NVML functions that the go-nvml
// in go.mod calls: regenerate it and compare.
func TestTrampolinesMatchGoNVML(t *testing.T) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}} {{.Version}}", "github.com/NVIDIA/go-nvml").Output()
	if err != nil {
		t.Skipf("cannot locate go-nvml's sources: %v", err)
	}
	f := strings.Fields(string(out))
	if len(f) != 2 {
		t.Skipf("go-nvml is not in the module cache (go list: %q)", out)
	}
	syms, err := nvmlsyms.Scan(filepath.Join(f[0], "pkg", "nvml"))
	if err != nil {
		t.Fatal(err)
	}
	want := nvmlsyms.Render(syms, "github.com/NVIDIA/go-nvml "+f[1])
	got, err := os.ReadFile("zz_nvml_trampolines_linux_amd64.c")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("zz_nvml_trampolines_linux_amd64.c is stale: run go generate in cuda/driver")
	}
	var str int
	for _, s := range syms {
		if s.ReturnsString {
			str++
		}
	}
	t.Logf("%d NVML functions (%d returning const char*)", len(syms), str)
}
