// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package driver_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
)

// A c-shared library importing this package must leave no CUDA or NVML
// symbol undefined (everything is reached through dlopen/dlsym or the hidden
// NVML trampolines) and export none of the trampolines; it must load with
// dlopen(RTLD_NOW) (ctypes.CDLL) and link into a C program with default
// flags.
func TestCSharedLinksCleanly(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a c-shared library (seconds)")
	}
	for _, tool := range []string{"go", "nm"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not found: %v", tool, err)
		}
	}
	dir := t.TempDir()
	lib := filepath.Join(dir, "libprobe.so")
	build := exec.Command("go", "build", "-buildmode=c-shared", "-o", lib, "./testdata/cshared")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build -buildmode=c-shared: %v\n%s", err, out)
	}

	undefined := nm(t, "-D", "--undefined-only", lib)
	bad := regexp.MustCompile(`(?m)^\s*\S+\s+((?:cu|nvml)[A-Za-z0-9_]*)`)
	if m := bad.FindAllString(undefined, -1); m != nil {
		t.Errorf("undefined CUDA/NVML symbols in the c-shared library:\n%s", strings.Join(m, "\n"))
	}
	t.Logf("nm -D --undefined-only: %d symbols, none cu*/nvml*", strings.Count(undefined, "\n"))

	defined := nm(t, "-D", "--defined-only", lib)
	exported := regexp.MustCompile(`(?m)^\S+\s+\S+\s+((?:nvml|cp_)[A-Za-z0-9_]*)$`)
	if m := exported.FindAllString(defined, -1); m != nil {
		t.Errorf("trampolines or shim symbols exported:\n%s", strings.Join(m, "\n"))
	}
	if runtime.GOARCH == "amd64" {
		// The trampolines are there, as local symbols.
		if all := nm(t, lib); !regexp.MustCompile(`(?m) t nvmlInit_v2$`).MatchString(all) {
			t.Error("nvmlInit_v2 is not a local text symbol of the library")
		}
	}

	if py, err := exec.LookPath("python3"); err == nil {
		out, err := exec.Command(py, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print('loaded')", lib).CombinedOutput()
		if err != nil {
			t.Errorf("ctypes.CDLL: %v\n%s", err, out)
		}
	} else {
		t.Log("python3 not found: ctypes check skipped")
	}

	if cc, err := exec.LookPath("gcc"); err == nil {
		src := filepath.Join(dir, "main.c")
		prog := filepath.Join(dir, "probe")
		if err := os.WriteFile(src, []byte(`#include <stdio.h>
extern int CudapoolProbe(void);
int main(void) { printf("devices=%d\n", CudapoolProbe()); return 0; }
`), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(cc, "-o", prog, src, lib).CombinedOutput(); err != nil {
			t.Fatalf("linking a C program against the library: %v\n%s", err, out)
		}
		run := exec.Command(prog)
		run.Env = append(os.Environ(), "LD_LIBRARY_PATH="+dir)
		out, err := run.CombinedOutput()
		if err != nil {
			t.Fatalf("running the C program: %v\n%s", err, out)
		}
		t.Logf("C program: %s", strings.TrimSpace(string(out)))
	} else {
		t.Log("gcc not found: C link check skipped")
	}
}

func nm(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("nm", args...).Output()
	if err != nil {
		t.Fatalf("nm %s: %v", strings.Join(args, " "), err)
	}
	return string(out)
}
