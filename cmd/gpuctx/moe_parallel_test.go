package main

import (
	"encoding/json"
	"math"
	"path/filepath"
	"strings"
	"testing"
)

// TestMoeRunGPUs: moe run --gpus N --backend cpu (expert parallel over N
// CPU-backend runtimes) writes the one-device output bitwise in f32, and
// within 2e-2 in bf16. The batch (40 tokens) is above the small-batch size,
// so the one-device layer takes the grouped-GEMM path, as the shards do.
func TestMoeRunGPUs(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "x.safetensors")
	writeX(t, in, []int{40, 64})
	run := func(t *testing.T, gpus, dtype string, extra ...string) []float32 {
		t.Helper()
		out := filepath.Join(t.TempDir(), "y.safetensors")
		args := append([]string{"moe", "run", "--model", fixture, "--input", in, "--output", out,
			"--gpus", gpus, "--backend", "cpu", "--dtype", dtype}, extra...)
		code, stdout, stderr := execute(t, args...)
		if code != 0 || stderr != "" {
			t.Fatalf("%v: exit code %d, stderr %q", args, code, stderr)
		}
		if gpus != "1" && len(extra) == 0 && !strings.Contains(stdout, "expert parallel") {
			t.Errorf("summary does not say expert parallel:\n%s", stdout)
		}
		y, _ := readTensor(t, out, "y")
		return y
	}
	for _, dtype := range []string{"f32", "bf16"} {
		want := run(t, "1", dtype)
		for _, gpus := range []string{"2", "3"} {
			t.Run(dtype+"/gpus="+gpus, func(t *testing.T) {
				got := run(t, gpus, dtype)
				if len(got) != len(want) {
					t.Fatalf("%d values, want %d", len(got), len(want))
				}
				var maxRef, maxDiff float64
				for i := range want {
					if dtype == "f32" && math.Float32bits(got[i]) != math.Float32bits(want[i]) {
						t.Fatalf("y[%d] = %v, one device %v: not bitwise equal", i, got[i], want[i])
					}
					maxRef = max(maxRef, math.Abs(float64(want[i])))
					maxDiff = max(maxDiff, math.Abs(float64(got[i])-float64(want[i])))
				}
				if rel := maxDiff / maxRef; !(rel <= 2e-2) {
					t.Errorf("max|y-y1|/max|y1| = %.3g > 2e-2", rel)
				}
			})
		}
	}
	t.Run("json", func(t *testing.T) {
		out := filepath.Join(t.TempDir(), "y.safetensors")
		code, stdout, stderr := execute(t, "moe", "run", "--model", fixture, "--input", in, "--output", out, "--gpus", "2", "--backend", "cpu", "--json")
		if code != 0 {
			t.Fatalf("exit code %d, stderr %q", code, stderr)
		}
		var rep moeRunReport
		dec := json.NewDecoder(strings.NewReader(stdout))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&rep); err != nil {
			t.Fatalf("--json output does not parse: %v\n%s", err, stdout)
		}
		if rep.GPUs != 2 || rep.Mode != "expert-parallel" || rep.Tokens != 40 {
			t.Errorf("report %+v does not describe the run", rep)
		}
	})
	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"zero", []string{"--gpus", "0"}, "--gpus 0"},
		{"trace", []string{"--gpus", "2", "--trace", filepath.Join(dir, "t.json")}, "--trace with --gpus"},
		{"more than experts", []string{"--gpus", "99"}, "expert-parallel"},
	} {
		t.Run("fails/"+c.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "y.safetensors")
			args := append([]string{"moe", "run", "--model", fixture, "--input", in, "--output", out, "--backend", "cpu"}, c.args...)
			code, _, stderr := execute(t, args...)
			if code != 1 || !strings.Contains(stderr, c.want) {
				t.Errorf("exit code %d, stderr %q; want 1 and %q", code, stderr, c.want)
			}
		})
	}
}
