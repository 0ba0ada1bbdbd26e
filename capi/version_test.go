// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
)

func readRepoFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile("../" + path)
	if err != nil {
		t.Fatalf("reading %s: %v", path, err)
	}
	return string(b)
}

// find returns the first submatch of pattern in the file, failing the test
// when there is none.
func find(t *testing.T, path, text, pattern string) string {
	t.Helper()
	m := regexp.MustCompile(pattern).FindStringSubmatch(text)
	if m == nil {
		t.Fatalf("%s: no match for %s", path, pattern)
	}
	return m[1]
}

// TestVersionsAgree guards the one version string: VERSION, the Go
// constants, the header's macros and the Python package must all say the
// same, and the ABI number must be the same in Go, C and Python.
func TestVersionsAgree(t *testing.T) {
	want := strings.TrimSpace(readRepoFile(t, "VERSION"))
	if !regexp.MustCompile(`^\d+\.\d+\.\d+$`).MatchString(want) {
		t.Fatalf("VERSION is %q, want MAJOR.MINOR.PATCH", want)
	}
	if got := fmt.Sprintf("%d.%d.%d", versionMajor, versionMinor, versionPatch); got != want {
		t.Errorf("capi/version.go says %s, VERSION says %s", got, want)
	}

	const hdr = "include/cudapool.h"
	h := readRepoFile(t, hdr)
	macro := func(name string) string { return find(t, hdr, h, `(?m)^#define `+name+` +(\S+)\s*$`) }
	if got := macro("CUDAPOOL_VERSION_MAJOR") + "." + macro("CUDAPOOL_VERSION_MINOR") + "." + macro("CUDAPOOL_VERSION_PATCH"); got != want {
		t.Errorf("%s's CUDAPOOL_VERSION_MAJOR/MINOR/PATCH say %s, VERSION says %s", hdr, got, want)
	}
	if got := macro("CUDAPOOL_VERSION_STRING"); got != `"`+want+`"` {
		t.Errorf("%s's CUDAPOOL_VERSION_STRING is %s, VERSION says %s", hdr, got, want)
	}
	if got := macro("CUDAPOOL_ABI_VERSION"); got != fmt.Sprint(abiVersion) {
		t.Errorf("%s's CUDAPOOL_ABI_VERSION is %s, capi/version.go's abiVersion %d", hdr, got, abiVersion)
	}

	const py = "python/cudapool/_version.py"
	p := readRepoFile(t, py)
	if got := find(t, py, p, `(?m)^__version__ = "([^"]*)"$`); got != want {
		t.Errorf("%s says %s, VERSION says %s", py, got, want)
	}
	if got := find(t, py, p, `(?m)^ABI_VERSION = (\d+)$`); got != fmt.Sprint(abiVersion) {
		t.Errorf("%s's ABI_VERSION is %s, capi/version.go's abiVersion %d", py, got, abiVersion)
	}

	// pyproject.toml takes the version from _version.py, not a copy of its own.
	const pp = "python/pyproject.toml"
	toml := readRepoFile(t, pp)
	if regexp.MustCompile(`(?m)^version *= *"`).MatchString(toml) {
		t.Errorf("%s sets a version of its own; it must be dynamic (from cudapool/_version.py)", pp)
	}
	if !strings.Contains(toml, `version = { attr = "cudapool._version.__version__" }`) {
		t.Errorf("%s does not read its version from cudapool._version.__version__", pp)
	}
}
