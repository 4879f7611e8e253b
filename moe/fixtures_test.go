package moe

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// TestFixtures compares Reference and Route with the outputs of the transformers
// MoE blocks recorded by bench/peers/make_moe_fixtures.py in moe/testdata/<name>/.
func TestFixtures(t *testing.T) {
	dirs, _ := filepath.Glob(filepath.Join("testdata", "*", "config.json"))
	if len(dirs) == 0 {
		t.Skip("no fixtures in moe/testdata yet: run bench/peers/make_moe_fixtures.py on the GPU machine and commit its output under moe/testdata/")
	}
	for _, cj := range dirs {
		dir := filepath.Dir(cj)
		t.Run(filepath.Base(dir), func(t *testing.T) { checkFixture(t, dir) })
	}
}

func checkFixture(t *testing.T, dir string) {
	cfg, err := LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	layer := 1
	if data, err := os.ReadFile(filepath.Join(dir, "meta.json")); err == nil {
		var m struct {
			Layer *int `json:"layer"`
		}
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatalf("meta.json: %v", err)
		}
		if m.Layer != nil {
			layer = *m.Layer
		}
	}
	w, err := LoadWeights(dir, cfg, layer)
	if err != nil {
		t.Fatal(err)
	}
	in, err := safetensors.Open(filepath.Join(dir, "input.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	exp, err := safetensors.Open(filepath.Join(dir, "expected.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer exp.Close()
	H, K := cfg.HiddenSize, cfg.TopK
	n := 0
	for _, name := range in.Header.Names() {
		if !strings.HasPrefix(name, "x") {
			continue
		}
		suffix := strings.TrimPrefix(name, "x")
		x, info, err := in.Float32(name)
		if err != nil {
			t.Fatal(err)
		}
		if len(info.Shape) != 2 || info.Shape[1] != H {
			t.Fatalf("%s has shape %v, want [T,%d]", name, info.Shape, H)
		}
		T := info.Shape[0]
		want, _, err := exp.Float32("y" + suffix)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Reference(cfg, w, x, T)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(want) {
			t.Fatalf("y%s: %d values, expected file has %d", suffix, len(got), len(want))
		}
		var maxRef, maxDiff float64
		for i := range got {
			maxRef = max(maxRef, math.Abs(float64(want[i])))
			maxDiff = max(maxDiff, math.Abs(float64(got[i])-float64(want[i])))
		}
		if rel := maxDiff / maxRef; !(rel <= 1e-5) {
			t.Errorf("y%s (T=%d): max|ref-hf|/max|hf| = %.3g > 1e-5", suffix, T, rel)
		} else {
			t.Logf("y%s (T=%d): relative error %.3g", suffix, T, rel)
		}
		n++
		// Routing, when the fixture recorded it: same expert set per token, same weights.
		if _, ok := exp.Info("topk_idx" + suffix); !ok {
			continue
		}
		hfIdx := readInts(t, exp, "topk_idx"+suffix)
		hfW, _, err := exp.Float32("topk_weight" + suffix)
		if err != nil {
			t.Fatal(err)
		}
		idx, wt, err := Route(cfg, w, x, T)
		if err != nil {
			t.Fatal(err)
		}
		if len(hfIdx) != T*K || len(hfW) != T*K {
			t.Fatalf("topk%s: %d indices, %d weights, want %d", suffix, len(hfIdx), len(hfW), T*K)
		}
		for tk := 0; tk < T; tk++ {
			hf := map[int64]float32{}
			for k := 0; k < K; k++ {
				hf[hfIdx[tk*K+k]] = hfW[tk*K+k]
			}
			for k := 0; k < K; k++ {
				hw, ok := hf[int64(idx[tk*K+k])]
				if !ok {
					t.Fatalf("token %d: Route chose %v, transformers %v", tk, idx[tk*K:(tk+1)*K], hfIdx[tk*K:(tk+1)*K])
				}
				if d := math.Abs(float64(hw) - float64(wt[tk*K+k])); d > 1e-5*math.Max(1, math.Abs(float64(hw))) {
					t.Fatalf("token %d expert %d: weight %v, transformers %v", tk, idx[tk*K+k], wt[tk*K+k], hw)
				}
			}
		}
	}
	if n == 0 {
		t.Fatalf("%s/input.safetensors has no tensor named x*", dir)
	}
}

func readInts(t *testing.T, f *safetensors.File, name string) []int64 {
	t.Helper()
	b, info, err := f.Bytes(name)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]int64, info.NumElements())
	for i := range out {
		switch info.DType {
		case safetensors.I64:
			out[i] = int64(binary.LittleEndian.Uint64(b[8*i:]))
		case safetensors.I32:
			out[i] = int64(int32(binary.LittleEndian.Uint32(b[4*i:])))
		default:
			t.Fatalf("%s has dtype %s, want I32 or I64", name, info.DType)
		}
	}
	return out
}

// TestCheckFixtureSynthetic runs the fixture comparison on a fixture written by
// this package (in the layout make_moe_fixtures.py writes), so the comparison
// code itself is exercised before the real fixtures exist.
func TestCheckFixtureSynthetic(t *testing.T) {
	cfg := variants()["deepseek_v3"]
	dir := t.TempDir()
	cj := `{"model_type":"deepseek_v3","hidden_size":16,"n_routed_experts":8,"num_experts_per_tok":3,
		"moe_intermediate_size":8,"n_shared_experts":1,"n_group":4,"topk_group":2,"norm_topk_prob":true,
		"routed_scaling_factor":2.5,"num_hidden_layers":2,"first_k_dense_replace":0,"hidden_act":"silu"}`
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cj), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "meta.json"), []byte(`{"layer":1}`), 0o644); err != nil {
		t.Fatal(err)
	}
	w, _ := RandomWeights(cfg, 5)
	ts, err := LayerTensors(cfg, w, 1, Fused, safetensors.F32)
	if err != nil {
		t.Fatal(err)
	}
	writeCheckpoint(t, dir, ts, 1)
	var in, exp []safetensors.Tensor
	for suffix, T := range map[string]int{"": 7, "_t1": 1} {
		x := make([]float32, T*16)
		for i := range x {
			x[i] = float32(math.Sin(float64(i+T))) * 2
		}
		y, _ := Reference(cfg, w, x, T)
		idx, wt, _ := Route(cfg, w, x, T)
		// Reverse each token's order: the comparison must treat selections as sets.
		for tk := 0; tk < T; tk++ {
			for a, b := tk*3, tk*3+2; a < b; a, b = a+1, b-1 {
				idx[a], idx[b] = idx[b], idx[a]
				wt[a], wt[b] = wt[b], wt[a]
			}
		}
		xt, _ := safetensors.FromFloat32("x"+suffix, safetensors.F32, []int{T, 16}, x)
		yt, _ := safetensors.FromFloat32("y"+suffix, safetensors.F32, []int{T, 16}, y)
		it, _ := safetensors.FromInt32("topk_idx"+suffix, []int{T, 3}, idx)
		wtt, _ := safetensors.FromFloat32("topk_weight"+suffix, safetensors.F32, []int{T, 3}, wt)
		in = append(in, xt)
		exp = append(exp, yt, it, wtt)
	}
	if err := safetensors.Write(filepath.Join(dir, "input.safetensors"), in, nil); err != nil {
		t.Fatal(err)
	}
	if err := safetensors.Write(filepath.Join(dir, "expected.safetensors"), exp, nil); err != nil {
		t.Fatal(err)
	}
	checkFixture(t, dir)
}
