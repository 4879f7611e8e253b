package main

import (
	"errors"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/collective/nccl"
)

// TestPickMoeComm: --gpus above 1 uses the in-process group; an explicit
// --gpus 1 on CUDA goes through a one-rank NCCL communicator when NCCL loads,
// and runs the one-device layer when it does not, with --trace, without
// --gpus (the default), and on every other backend (where NCCL is never even
// loaded).
func TestPickMoeComm(t *testing.T) {
	lib := &nccl.Lib{}
	found := func() (*nccl.Lib, error) { return lib, nil }
	missing := func() (*nccl.Lib, error) { return nil, errors.New("no libnccl.so.2") }
	for _, tc := range []struct {
		name     string
		backend  string
		gpus     int
		explicit bool // --gpus given
		tracing  bool
		load     func() (*nccl.Lib, error)
		want     moeComm
		wantLoad bool
	}{
		{"cuda, --gpus 1, NCCL", "cuda", 1, true, false, found, commNCCL, true},
		{"cuda, no --gpus (default 1), NCCL", "cuda", 1, false, false, found, commNone, false},
		{"cuda, --gpus 1, no NCCL", "cuda", 1, true, false, missing, commNone, true},
		{"cuda, --gpus 1, tracing", "cuda", 1, true, true, found, commNone, false},
		{"cuda, two GPUs", "cuda", 2, true, false, found, commLocal, false},
		{"cpu, --gpus 1", "cpu", 1, true, false, found, commNone, false},
		{"cpu, three devices", "cpu", 3, true, false, found, commLocal, false},
		{"rocm, --gpus 1", "rocm", 1, true, false, found, commNone, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			loaded := false
			load := func() (*nccl.Lib, error) { loaded = true; return tc.load() }
			got, l := pickMoeComm(tc.backend, tc.gpus, tc.explicit, tc.tracing, load)
			if got != tc.want || loaded != tc.wantLoad {
				t.Errorf("pickMoeComm = %d (NCCL loaded %v), want %d (loaded %v)", got, loaded, tc.want, tc.wantLoad)
			}
			if (l != nil) != (got == commNCCL) {
				t.Errorf("library %v with communicator %d", l, got)
			}
		})
	}
}

// TestMoeRunOneGPUNCCL (CUDA with NCCL only): moe run --gpus 1 on CUDA goes
// through a one-rank NCCL communicator and writes what the CPU backend's
// one-device layer writes, within f32 rounding.
func TestMoeRunOneGPUNCCL(t *testing.T) {
	rt, err := gpuctx.OpenBackend("cuda")
	if err != nil {
		t.Skipf("skipped: no CUDA backend here: %v", err)
	}
	_ = rt.Close()
	if _, err := nccl.Load(); err != nil {
		t.Skipf("skipped: NCCL not loadable: %v", err)
	}
	dir := t.TempDir()
	in := filepath.Join(dir, "x.safetensors")
	writeX(t, in, []int{40, 64})
	run := func(backend string) ([]float32, string) {
		out := filepath.Join(t.TempDir(), "y.safetensors")
		code, stdout, stderr := execute(t, "moe", "run", "--model", fixture, "--input", in, "--output", out,
			"--gpus", "1", "--backend", backend, "--dtype", "f32")
		if code != 0 || stderr != "" {
			t.Fatalf("--backend %s: exit code %d, stderr %q", backend, code, stderr)
		}
		y, _ := readTensor(t, out, "y")
		return y, stdout
	}
	want, _ := run("cpu")
	got, stdout := run("cuda")
	if !strings.Contains(stdout, "one-rank NCCL") {
		t.Errorf("summary does not say NCCL:\n%s", stdout)
	}
	if len(got) != len(want) {
		t.Fatalf("%d values, want %d", len(got), len(want))
	}
	var maxRef, maxDiff float64
	for i := range want {
		maxRef = max(maxRef, math.Abs(float64(want[i])))
		maxDiff = max(maxDiff, math.Abs(float64(got[i])-float64(want[i])))
	}
	if rel := maxDiff / maxRef; !(rel <= 1e-3) {
		t.Errorf("max|y_cuda-y_cpu|/max|y_cpu| = %.3g > 1e-3", rel)
	}
}
