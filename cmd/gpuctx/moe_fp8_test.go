package main

import (
	"encoding/json"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/bench"
	"github.com/gpuctx/gpuctx/moe"
	"github.com/gpuctx/gpuctx/moe/fp8"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// TestMoeFP8EndToEnd writes an FP8 checkpoint of every preset (small) with
// moe init --dtype fp8 and checks that it is in the Hub's format (config's
// quantization_config; each projection F8_E4M3 with its F32 scales, the
// router BF16, the bias F32), that moe init never overwrites it, and that
// moe run reads it as fp8, bf16 and f32 on the CPU backend: fp8's y within
// 1e-2 of f32's (which reads the dequantized weights), -v and --json
// reporting the weights' device memory, the fp8 layer's smaller, and the
// layer's whole device memory, which MemInfo agrees with (checkRunMemory).
func TestMoeFP8EndToEnd(t *testing.T) {
	for _, preset := range moe.PresetNames() {
		t.Run(preset, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ckpt")
			code, out, errOut := execute(t, "moe", "init", "--preset", preset, "--small", "--tokens", "5", "--dtype", "fp8", "--dir", dir)
			if code != 0 {
				t.Fatalf("moe init --dtype fp8: exit %d\n%s%s", code, out, errOut)
			}
			if !strings.Contains(out, "--dtype fp8 -v") || !strings.Contains(out, "F8_E4M3 with F32 block scales") {
				t.Errorf("moe init's summary does not describe the FP8 checkpoint:\n%s", out)
			}
			checkHubFP8(t, dir)
			code, out, errOut = execute(t, "moe", "init", "--preset", preset, "--small", "--dtype", "fp8", "--dir", dir)
			wantOneLineFailure(t, code, out, errOut, "already holds config.json", "never overwrites")

			ys := map[string][]float32{}
			bytes := map[string]int64{}
			for _, dt := range []string{"fp8", "bf16", "f32"} {
				y := filepath.Join(t.TempDir(), "y.safetensors")
				code, out, errOut := execute(t, "--json", "moe", "run", "--backend", "cpu", "--model", dir, "--input", filepath.Join(dir, "input.safetensors"),
					"--output", y, "--dtype", dt, "--mode", "dual", "-v")
				if code != 0 {
					t.Fatalf("moe run --dtype %s: exit %d\n%s%s", dt, code, out, errOut)
				}
				var rep moeRunReport
				if err := json.Unmarshal([]byte(out), &rep); err != nil {
					t.Fatalf("--json: %v\n%s", err, out)
				}
				if rep.DType != dt || rep.WeightBytes <= 0 {
					t.Errorf("--dtype %s: report says dtype %q, weight_device_bytes %d", dt, rep.DType, rep.WeightBytes)
				}
				if !strings.Contains(errOut, "weights on the device: ") || (dt == "fp8") != strings.Contains(errOut, "routed experts in FP8") {
					t.Errorf("--dtype %s -v does not report the weights' device memory:\n%s", dt, errOut)
				}
				checkRunMemory(t, dt, rep, errOut)
				ys[dt], _ = readTensor(t, y, "y")
				bytes[dt] = rep.WeightBytes
			}
			if rel := relDiff(ys["fp8"], ys["f32"]); !(rel <= 1e-2) {
				t.Errorf("fp8's y differs from f32's (dequantized weights) by %.3g relative, want <= 1e-2", rel)
			}
			// --mode fused: the shared expert's FP8 chunks inside the FP8 tiles
			// (where the preset's shared expert can be fused), within the
			// shared expert's E4M3 rounding of dual.
			y := filepath.Join(t.TempDir(), "y.safetensors")
			code, out, errOut = execute(t, "--json", "moe", "run", "--backend", "cpu", "--model", dir, "--input", filepath.Join(dir, "input.safetensors"),
				"--output", y, "--dtype", "fp8", "--mode", "fused")
			if code != 0 {
				t.Fatalf("moe run --dtype fp8 --mode fused: exit %d\n%s%s", code, out, errOut)
			}
			fused, _ := readTensor(t, y, "y")
			if rel := relDiff(fused, ys["fp8"]); !(rel <= fp8FusedCheckTol) {
				t.Errorf("fp8 --mode fused differs from --mode dual by %.3g relative, want <= %g", rel, fp8FusedCheckTol)
			}
			if !(bytes["fp8"] < bytes["bf16"]) {
				t.Errorf("device weight bytes: fp8 %d, bf16 %d", bytes["fp8"], bytes["bf16"])
			}
		})
	}
}

// checkRunMemory checks moe run's device memory (--json's device_memory and
// mem_info_drop_bytes, -v's line) on the CPU backend, whose MemInfo counts
// every buffer: the fall of free memory over load and forward equals the
// layer's total, its weights are weight_device_bytes (FP8 codes and scales
// among them only in fp8), and -v prints the same numbers.
func checkRunMemory(t *testing.T, dt string, rep moeRunReport, errOut string) {
	t.Helper()
	m := rep.DeviceMemory
	if m == nil || rep.MemInfoDrop == nil {
		t.Fatalf("--dtype %s: --json lacks device_memory (%v) or mem_info_drop_bytes (%v)", dt, m, rep.MemInfoDrop)
	}
	if *rep.MemInfoDrop != m.TotalBytes || m.TotalBytes != m.Total() || m.Weights != rep.WeightBytes || m.Scratch <= 0 || m.PinnedHost <= 0 ||
		(dt == "fp8") != (m.FP8Codes > 0 && m.FP8Scales > 0) {
		t.Errorf("--dtype %s: device_memory %+v, mem_info_drop_bytes %d, weight_device_bytes %d", dt, *m, *rep.MemInfoDrop, rep.WeightBytes)
	}
	line := fmt.Sprintf("device memory: %s; free device memory fell by %s over load and forward (MemInfo)\n", m.Text(), bench.ByteSize(*rep.MemInfoDrop))
	if !strings.Contains(errOut, line) {
		t.Errorf("--dtype %s -v lacks %q:\n%s", dt, line, errOut)
	}
}

// relDiff is max|a-b| / max|b|.
func relDiff(a, b []float32) float64 {
	var d, m float64
	for i := range b {
		d = max(d, math.Abs(float64(a[i])-float64(b[i])))
		m = max(m, math.Abs(float64(b[i])))
	}
	return d / m
}

// checkHubFP8 checks that dir holds a checkpoint in the Hub's FP8 format.
func checkHubFP8(t *testing.T, dir string) {
	t.Helper()
	cfg, err := moe.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Quant == nil || cfg.Quant.QuantMethod != "fp8" || cfg.Quant.Fmt != "e4m3" || cfg.Quant.Block() != [2]int{128, 128} {
		t.Fatalf("config.json's quantization_config: %+v", cfg.Quant)
	}
	f, err := safetensors.Open(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var nFP8 int
	for _, name := range f.Header.Names() {
		info, _ := f.Info(name)
		switch {
		case strings.HasSuffix(name, "_scale_inv"):
			if info.DType != safetensors.F32 {
				t.Errorf("%s: %s, want F32", name, info.DType)
			}
		case fp8.Quantizable(name):
			nFP8++
			if _, ok := f.Info(fp8.ScaleName(name)); info.DType != safetensors.F8E4M3 || !ok {
				t.Errorf("%s: %s (scales present: %v), want F8_E4M3 with scales", name, info.DType, ok)
			}
		case strings.HasSuffix(name, "e_score_correction_bias"):
			if info.DType != safetensors.F32 {
				t.Errorf("%s: %s, want F32", name, info.DType)
			}
		default:
			if info.DType != safetensors.BF16 {
				t.Errorf("%s: %s, want BF16", name, info.DType)
			}
		}
	}
	if want := 3 * cfg.NumExperts; nFP8 < want {
		t.Errorf("%d FP8 weights, want at least the %d of the routed experts", nFP8, want)
	}
}

// TestMoeFP8Bench times a preset with --dtype fp8 on the CPU backend.
func TestMoeFP8Bench(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	code, stdout, stderr := execute(t, "moe", "bench", "--preset", "deepseek-v3", "--tokens", "1,4", "--iters", "2", "--warmup", "0", "--dtype", "fp8", "--mode", "single,dual,auto,fused")
	if code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, stderr)
	}
	for _, w := range []string{", fp8, CPU", "dtype fp8", "GEMM", "(bf16 512³", "output check: every mode's last timed outputs", "passed", "tolerance 0.1"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("output lacks %q:\n%s", w, stdout)
		}
	}
}

// TestMoeFP8Failures checks the flags --dtype fp8 refuses: one line each.
func TestMoeFP8Failures(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	dir := t.TempDir()
	in := filepath.Join(dir, "x.safetensors")
	writeX(t, in, []int{2, 16})
	for _, c := range []struct {
		name string
		args []string
		want []string
	}{
		{"bench tile", []string{"moe", "bench", "--dtype", "fp8", "--tokens", "1", "--tile", moe.TileTags()[0]}, []string{"--dtype fp8 with --tile", "drop --tile"}},
		{"bench small batch", []string{"moe", "bench", "--dtype", "fp8", "--small-batch", "4"}, []string{"--dtype fp8 with --small-batch 4"}},
		{"run gpus", []string{"moe", "run", "--model", fixture, "--input", in, "--output", filepath.Join(dir, "y.safetensors"), "--dtype", "fp8", "--gpus", "2"},
			[]string{"--dtype fp8 with --gpus above 1"}},
		{"run dtype", []string{"moe", "run", "--model", fixture, "--input", in, "--output", filepath.Join(dir, "y.safetensors"), "--dtype", "fp4"},
			[]string{`--dtype "fp4" is not supported`, "fp8"}},
		{"init dtype", []string{"moe", "init", "--dir", dir, "--dtype", "e5m2"}, []string{`--dtype "e5m2"`, "fp8"}},
		{"bench weight-only bf16", []string{"moe", "bench", "--fp8-weight-only", "--tokens", "1"}, []string{"--fp8-weight-only without --dtype fp8", "add --dtype fp8"}},
		{"run weight-only f32", []string{"moe", "run", "--model", fixture, "--input", in, "--output", filepath.Join(dir, "y.safetensors"), "--fp8-weight-only"},
			[]string{"--fp8-weight-only without --dtype fp8"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := execute(t, c.args...)
			wantOneLineFailure(t, code, stdout, stderr, c.want...)
		})
	}
}

// TestHasFP8MMA checks the compute capabilities info calls FP8 MMA.
func TestHasFP8MMA(t *testing.T) {
	for _, c := range []struct {
		major, minor int
		want         bool
	}{{0, 0, false}, {7, 5, false}, {8, 0, false}, {8, 6, false}, {8, 9, true}, {9, 0, true}, {10, 0, true}, {12, 0, true}} {
		if got := hasFP8MMA(c.major, c.minor); got != c.want {
			t.Errorf("hasFP8MMA(%d, %d) = %v, want %v", c.major, c.minor, got, c.want)
		}
	}
}

// TestMoeFP8BenchWeightOnly times a preset with --dtype fp8
// --fp8-weight-only on the CPU backend: the report says the activations
// stayed bf16 (moe's TestLayerFP8WeightOnly checks that no w8a8 tile runs).
func TestMoeFP8BenchWeightOnly(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	code, stdout, stderr := execute(t, "moe", "bench", "--preset", "qwen3-30b-a3b", "--tokens", "64", "--iters", "1", "--warmup", "0", "--dtype", "fp8", "--fp8-weight-only", "--mode", "single")
	if code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, stderr)
	}
	for _, w := range []string{"dtype fp8", "--fp8-weight-only: the routed experts ran the w8a16 tiles only", "passed"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("output lacks %q:\n%s", w, stdout)
		}
	}
}
