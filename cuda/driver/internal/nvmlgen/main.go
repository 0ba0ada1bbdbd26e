// SPDX-License-Identifier: Apache-2.0

// Command nvmlgen writes cuda/driver's NVML trampoline file from the go-nvml
// sources in the module cache (see package nvmlsyms). Run from cuda/driver:
//
//	go generate ./...   (runs: go run ./internal/nvmlgen -out zz_nvml_trampolines_linux_amd64.c)
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/cudapool/cudapool/cuda/driver/internal/nvmlsyms"
)

func main() {
	out := flag.String("out", "zz_nvml_trampolines_linux_amd64.c", "output file")
	dir := flag.String("nvml", "", "go-nvml's pkg/nvml directory (default: from go list -m)")
	flag.Parse()

	source := "github.com/NVIDIA/go-nvml"
	if *dir == "" {
		b, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}} {{.Version}}", "github.com/NVIDIA/go-nvml").Output()
		if err != nil {
			fatal(fmt.Errorf("go list -m github.com/NVIDIA/go-nvml: %w", err))
		}
		f := strings.Fields(string(b))
		if len(f) != 2 {
			fatal(fmt.Errorf("unexpected go list output %q", b))
		}
		*dir = filepath.Join(f[0], "pkg", "nvml")
		source += " " + f[1]
	}
	syms, err := nvmlsyms.Scan(*dir)
	if err != nil {
		fatal(err)
	}
	if err := os.WriteFile(*out, nvmlsyms.Render(syms, source), 0o644); err != nil {
		fatal(err)
	}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "nvmlgen:", err)
	os.Exit(1)
}
