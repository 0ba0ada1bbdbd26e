// SPDX-License-Identifier: Apache-2.0

package vmem_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// Every release of a Space's physical allocation forgets its export and
// closes its descriptor (export.go): each function of the Space's files
// that releases a handle through the Space's driver (s.drv.MemRelease)
// also calls released. A descriptor left open after its release would
// keep the memory allocated until the process exits; one closed early
// would let another export reuse a number a handle in flight names. The
// import cache (its own handles) and the copier hold none of the Space's.
func TestEveryReleaseForgetsItsExport(t *testing.T) {
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	checked := 0
	for _, n := range names {
		if strings.HasSuffix(n, "_test.go") || n == "shareimport.go" || n == "copy.go" {
			continue
		}
		f, err := parser.ParseFile(fset, n, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			var releases, forgets bool
			ast.Inspect(fd.Body, func(x ast.Node) bool {
				call, ok := x.(*ast.CallExpr)
				if !ok {
					return true
				}
				sel, ok := call.Fun.(*ast.SelectorExpr)
				if !ok {
					return true
				}
				if sel.Sel.Name == "MemRelease" {
					if recv, ok := sel.X.(*ast.SelectorExpr); ok && recv.Sel.Name == "drv" {
						releases = true
					}
				}
				if sel.Sel.Name == "released" {
					forgets = true
				}
				return true
			})
			if releases {
				checked++
				if !forgets {
					t.Errorf("%s: %s releases a physical allocation without calling released (export.go)", n, fd.Name.Name)
				}
			}
		}
	}
	if checked < 4 {
		t.Fatalf("found %d functions that release physical allocations; the scan no longer sees them", checked)
	}
}
