package moe

import (
	"bytes"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/fp8"
)

// The CUDA tests of the FP8 layer: they skip where the CUDA backend does not
// open or the GPU has no bf16 mma.sync (compute capability below 8.0), and
// say which device ran. (TestLayerFP8 and TestLayerFP8DualBitwise also run
// on CUDA where it opens.)

// fp8CUDADevice opens the CUDA backend's device 0 (closed when the test
// ends), or skips.
func fp8CUDADevice(t *testing.T) *gpuctx.Device {
	t.Helper()
	rt, err := gpuctx.OpenBackend("cuda")
	if err != nil {
		t.Skipf("backend cuda not available, not tested: %s", firstLine(err))
	}
	t.Cleanup(func() { _ = rt.Close() })
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatalf("cuda: Device(0): %v", err)
	}
	info := dev.Info()
	if info.ComputeMajor < 8 {
		t.Skipf("cuda device %s is compute capability %d.%d; the FP8 tiles need 8.0", info.Name, info.ComputeMajor, info.ComputeMinor)
	}
	t.Logf("testing on backend cuda (%s, compute capability %d.%d)", info.Name, info.ComputeMajor, info.ComputeMinor)
	return dev
}

// fp8Dequantized returns w with every routed and shared expert's
// projections quantized in 128x128 blocks and dequantized again, and the
// other matrices rounded to bf16: the weights an FP8 layer built from w
// computes with (sharedStage.uploadFP8).
func fp8Dequantized(t *testing.T, cfg *Config, w *Weights) *Weights {
	t.Helper()
	out := *roundWeights(w)
	out.Experts = make([]Expert, len(w.Experts))
	H, I := cfg.HiddenSize, cfg.Intermediate
	rt := func(v []float32, rows, cols int) []float32 {
		q, err := fp8.Quantize(v, rows, cols, [2]int{fp8.BlockSize, fp8.BlockSize})
		if err != nil {
			t.Fatal(err)
		}
		d, err := q.Dequantize()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	for e, x := range w.Experts {
		out.Experts[e] = Expert{Gate: rt(x.Gate, I, H), Up: rt(x.Up, I, H), Down: rt(x.Down, H, I)}
	}
	if Is := cfg.SharedIntermediate; Is > 0 { // an FP8 layer quantizes the shared expert too
		out.Shared = &Expert{Gate: rt(w.Shared.Gate, Is, H), Up: rt(w.Shared.Up, Is, H), Down: rt(w.Shared.Down, H, Is)}
	}
	return &out
}

// TestLayerFP8CUDA runs FP8 layers on the GPU against the same layers on
// the CPU backend (the FP8 tiles' Go twins) and against the float64
// reference on the dequantized weights, both within 1e-2 relative, at 1 to
// 300 tokens (16- and 32-row tiles, partial blocks; at 300 tokens of 8
// experts the w8a8 tiles on compute capability 9.0, with the tolerances of
// TestLayerFP8W8A8); checks that Dual, Auto and graph replays are bitwise
// the GPU's Single (Auto where it picked FusedShared: FusedShared's); and runs
// FusedShared where the shared expert can be fused (checkFP8FusedCUDA).
func TestLayerFP8CUDA(t *testing.T) {
	gpu := fp8CUDADevice(t)
	cpu := layerBackends(t)[0].dev
	cfgs := fp8Configs()
	for _, name := range []string{"deepseek-v2-lite", "qwen3-30b-a3b", "deepseek-v3"} {
		cfgs["scaled-"+name] = scaledPresets()[name]
	}
	for name, cfg := range cfgs {
		t.Run(name, func(t *testing.T) {
			w, err := RandomWeights(cfg, 11)
			if err != nil {
				t.Fatal(err)
			}
			wq := fp8Dequantized(t, cfg, w)
			var wqf *Weights // FusedShared's weights, once the layer says its chunks
			// The rule's tiles on both backends (the CPU backend does not
			// tune): the tolerances below follow fp8Tiles' w8a8 choice, and
			// the tuner is TestLayerFP8Tune's.
			o := LayerOptions{DType: gpuctx.BF16, FP8: true, NoAutotune: true}
			lg, err := NewLayer(gpu, cfg, w, o)
			if err != nil {
				t.Fatal(err)
			}
			defer lg.Close()
			lc, err := NewLayer(cpu, cfg, w, o)
			if err != nil {
				t.Fatal(err)
			}
			defer lc.Close()
			for _, T := range []int{1, 8, 64, 300} {
				x := randomX(T, cfg.HiddenSize, uint64(T)+17)
				want, err := Reference(cfg, wq, roundAll(x), T)
				if err != nil {
					t.Fatal(err)
				}
				yc := lc.decode(deviceRun(t, lc, x, T, Single, Whole))
				single := deviceRun(t, lg, x, T, Single, Whole)
				yg := lg.decode(single)
				// w8a8 batches (the activations quantized too:
				// TestLayerFP8W8A8) get 8e-2 against Reference and
				// w8a8DeviceTol against referenceW8A8 and the CPU
				// backend's twins; 8e-2 against the CPU backend where
				// only that runs them.
				w8 := fp8Tiles(T, cfg.TopK, cfg.NumExperts, true).w8
				tolRef, tolCPU := 1e-2, 1e-2
				if w8 && lg.experts.q.w8 {
					tolRef, tolCPU = 8e-2, w8a8DeviceTol
					if rel := relErr(yg, referenceW8A8(cfg, wq, roundAll(x), T)); !(rel <= w8a8DeviceTol) {
						t.Errorf("T=%d: w8a8: the GPU differs from the float64 reference quantizing the activations by %.3g relative, want <= %g", T, rel, w8a8DeviceTol)
					}
				} else if w8 {
					tolCPU = 8e-2
				}
				if rel := relErr(yg, yc); !(rel <= tolCPU) {
					t.Errorf("T=%d: the GPU differs from the CPU backend by %.3g relative, want <= %g", T, rel, tolCPU)
				}
				if rel := relErr(yg, want); !(rel <= tolRef) {
					t.Errorf("T=%d: the GPU differs from the float64 reference on the dequantized weights by %.3g relative, want <= %g", T, rel, tolRef)
				}
				for _, mode := range []Mode{Dual, Auto, Single, Dual, Auto} { // the repeats replay graphs
					if got := deviceRun(t, lg, x, T, mode, Whole); !bytes.Equal(got, fp8AutoWant(t, lg, x, T, mode, single)) {
						t.Errorf("T=%d: %v differs from single (relative %.3g)", T, mode, relErr(lg.decode(got), yg))
					}
				}
				if lg.ns > 0 {
					if wqf == nil {
						wqf = fp8DequantizedFused(t, cfg, w, lg.ns)
					}
					checkFP8FusedCUDA(t, lg, lc, cfg, wqf, x, T)
				}
			}
		})
	}
}

// checkFP8FusedCUDA checks FusedShared of FP8 layer lg (on the GPU) on T
// tokens x: within 1e-2 relative of the same layer on the CPU backend (lc)
// and of the float64 reference on the weights it holds (wqf:
// fp8DequantizedFused), and its graph replays bitwise the first forward.
func checkFP8FusedCUDA(t *testing.T, lg, lc *Layer, cfg *Config, wqf *Weights, x []float32, T int) {
	t.Helper()
	want, err := Reference(cfg, wqf, roundAll(x), T)
	if err != nil {
		t.Fatal(err)
	}
	fused := deviceRun(t, lg, x, T, FusedShared, Whole)
	y := lg.decode(fused)
	if rel := relErr(y, lc.decode(deviceRun(t, lc, x, T, FusedShared, Whole))); !(rel <= 1e-2) {
		t.Errorf("T=%d: FusedShared on the GPU differs from the CPU backend by %.3g relative, want <= 1e-2", T, rel)
	}
	if rel := relErr(y, want); !(rel <= 1e-2) {
		t.Errorf("T=%d: FusedShared on the GPU differs from the float64 reference on its weights by %.3g relative, want <= 1e-2", T, rel)
	}
	for run := range 2 { // the capture, then a replay
		if again := deviceRun(t, lg, x, T, FusedShared, Whole); !bytes.Equal(again, fused) {
			t.Errorf("T=%d run %d: FusedShared on the GPU is not reproducible (relative %.3g)", T, run, relErr(lg.decode(again), y))
		}
	}
}
