package gpuctx_test

import (
	"go/build"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"
)

// layerRules is ARCHITECTURE.md's import rule as data: for each package of the
// module (by path relative to the module root; a trailing "/..." matches the
// subtree), the packages of the module it may import (same notation). Imports
// outside the module are not checked. The first matching entry wins.
var layerRules = []struct {
	pkg   string
	allow []string
}{
	{"cmd/...", []string{"..."}},
	{"internal/cmd/...", nil},
	// The benchmarks sit above moe (cmd -> bench -> moe): moe never imports
	// them, and only cmd does.
	{"bench", []string{".", "half", "moe", "internal/sysmem"}},
	{"conformance", []string{".", "half", "internal/blastest"}},
	{"moe/...", []string{".", "half", "kernels", "internal/blas", "moe/...", "internal/atomicfile", "internal/regfile", "collective"}},
	// Collectives: the Comm interface, the in-process group and the NCCL
	// binding (a loaded library, as the backends' are).
	{"collective/...", []string{".", "collective/...", "internal/dynload"}},
	// The public API opens the backends (OpenBackend) and reaches them only
	// through internal/hal.
	{".", []string{"internal/handlepool", "internal/hal", "backend/...", "internal/blas", "half"}},
	{"internal/handlepool", []string{"internal/hal"}},
	{"internal/blas", []string{"internal/hal"}},
	{"internal/blastest", []string{"internal/blas"}},
	// The backends are generic: they reach kernels only through the registry
	// of package kernels (CUDA compiles the registered sources, the CPU backend
	// runs the registered Go bodies). No backend imports moe (nor the MoE
	// kernels of moe/internal/moekernels), gpuctx or the handle pool.
	{"backend/...", []string{"backend/...", "internal/hal", "internal/dynload", "internal/sysmem", "half", "kernels"}},
	{"internal/hal", nil},
	{"internal/dynload", nil},
	{"internal/sysmem", nil},
	{"internal/atomicfile", []string{"internal/regfile"}},
	{"internal/regfile", nil},
	// The registry and the basic kernels: no MoE code, nothing above hal.
	{"kernels", []string{"internal/hal"}},
	{"half", nil},
}

const module = "github.com/gpuctx/gpuctx"

func matchPkg(pattern, rel string) bool {
	if pattern == "..." {
		return true
	}
	if p, ok := strings.CutSuffix(pattern, "/..."); ok {
		return rel == p || strings.HasPrefix(rel, p+"/")
	}
	return rel == pattern
}

// allowedImport reports whether the package rel may import dep (both relative
// to the module root, "." for the root), and whether any rule names rel.
func allowedImport(rel, dep string) (ok, known bool) {
	for _, r := range layerRules {
		if !matchPkg(r.pkg, rel) {
			continue
		}
		for _, a := range r.allow {
			if matchPkg(a, dep) {
				return true, true
			}
		}
		return false, true
	}
	return false, false
}

// TestImportLayers fails on an import that breaks ARCHITECTURE.md's layering
// (non-test imports of every package in the module), and on a package that no
// rule covers, so that a new package gets a place in the layers.
func TestImportLayers(t *testing.T) {
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		if name := d.Name(); p != "." && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata") {
			return filepath.SkipDir
		}
		bp, err := build.Default.ImportDir(p, 0)
		if err != nil {
			if _, ok := err.(*build.NoGoError); ok {
				return nil
			}
			t.Errorf("%s: %v", p, err)
			return nil
		}
		rel := filepath.ToSlash(p)
		for _, imp := range bp.Imports {
			if imp != module && !strings.HasPrefix(imp, module+"/") {
				continue
			}
			dep := strings.TrimPrefix(strings.TrimPrefix(imp, module), "/")
			if dep == "" {
				dep = "."
			}
			ok, known := allowedImport(rel, dep)
			if !known {
				t.Errorf("package %s is in no layer of ARCHITECTURE.md: add it to layerRules", path.Join(module, rel))
				break
			}
			if !ok {
				t.Errorf("%s imports %s: not allowed by ARCHITECTURE.md", path.Join(module, rel), imp)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestImportLayersRule checks the rule itself on the imports it must refuse.
func TestImportLayersRule(t *testing.T) {
	for _, tc := range []struct {
		pkg, dep string
		ok       bool
	}{
		{"backend/cpu", "moe", false},
		{"backend/cuda", "moe/safetensors", false},
		{"backend/cpu", ".", false},
		{"backend/cpu", "kernels", true},
		{"backend/cpu", "moe/internal/moekernels", false},
		{"backend/cuda", "moe/internal/moekernels", false},
		{"backend/cpu", "moe/safetensors", false},
		{"kernels", "moe/internal/moekernels", false},
		{"kernels", "moe", false},
		{"kernels", "internal/hal", true},
		{"kernels", ".", false},
		{"moe/internal/moekernels", "kernels", true},
		{"moe/internal/moekernels", ".", true},
		{"moe/internal/moekernels", "internal/hal", false},
		{"moe/internal/moekernels", "backend/cpu", false},
		{"backend/cuda/cublas", "internal/hal", true},
		{"moe", "backend/cpu", false},
		{"moe", "internal/hal", false},
		{"moe", ".", true},
		{"internal/handlepool", ".", false},
		{"internal/hal", "internal/handlepool", false},
		{".", "moe", false},
		{".", "internal/handlepool", true},
		{"cmd/gpuctx", "moe", true},
	} {
		if ok, _ := allowedImport(tc.pkg, tc.dep); ok != tc.ok {
			t.Errorf("%s -> %s: allowed %v, want %v", tc.pkg, tc.dep, ok, tc.ok)
		}
	}
}

// TestBackendsHoldNoMoECode fails when a non-test file of a backend or of the
// generic kernel registry names a MoE kernel or limit: the MoE kernels (CUDA
// source, Go twins, limits) belong to moe/internal/moekernels, which registers
// them; the imports rule alone would not catch a copy.
func TestBackendsHoldNoMoECode(t *testing.T) {
	banned := []string{"gpuctx_moe", "MOE_MAX", "MaxExperts", "MaxTopK", "MoEGemm"}
	for _, root := range []string{"backend", "kernels"} {
		err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || strings.HasSuffix(p, "_test.go") ||
				!(strings.HasSuffix(p, ".go") || strings.HasSuffix(p, ".cu") || strings.HasSuffix(p, ".cuh")) {
				return err
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			for _, w := range banned {
				if strings.Contains(string(b), w) {
					t.Errorf("%s mentions %s: MoE kernels and limits live in moe/internal/moekernels", filepath.ToSlash(p), w)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}
