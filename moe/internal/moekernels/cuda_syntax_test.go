package moekernels

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/kernels"
)

// TestCUDASourcesParse parses every registered CUDA source, exactly as NVRTC
// receives it (preludes and generated instances included), with the host C++
// compiler in syntax-only mode: testdata/cuda_shim.h declares the CUDA
// keywords and intrinsics the sources use as plain host declarations, so a
// syntax error, an undeclared name or a template that does not instantiate is
// found here, without a GPU. It checks no PTX, no inline assembly and nothing
// of the device's semantics (the CUDA tests on the GPU do). It skips where no
// g++ is installed.
func TestCUDASourcesParse(t *testing.T) {
	gxx, err := exec.LookPath("g++")
	if err != nil {
		t.Skip("g++ not found: the CUDA sources are not parsed on the host")
	}
	shim, err := filepath.Abs(filepath.Join("testdata", "cuda_shim.h"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for file, src := range kernels.Sources() {
		t.Run(file, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(dir, strings.ReplaceAll(file, "/", "_"))
			if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command(gxx, "-std=c++17", "-fsyntax-only", "-w", "-include", shim, "-x", "c++", path).CombinedOutput()
			if err != nil {
				lines := strings.Split(strings.TrimSpace(string(out)), "\n")
				t.Errorf("%s does not parse as C++ with %s (%v):\n%s", file, shim, err, strings.Join(lines[:min(len(lines), 20)], "\n"))
			}
		})
	}
}
