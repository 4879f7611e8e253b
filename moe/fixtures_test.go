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
	for _, dir := range fixtureDirs(t) {
		t.Run(filepath.Base(dir), func(t *testing.T) { checkFixture(t, dir) })
	}
}

// fixtureDirs returns the fixture directories under moe/testdata (each with
// a config.json), written by bench/peers/make_moe_fixtures.py; none is a
// failure, as they are committed.
func fixtureDirs(t *testing.T) []string {
	t.Helper()
	cjs, _ := filepath.Glob(filepath.Join("testdata", "*", "config.json"))
	if len(cjs) == 0 {
		t.Fatal("no fixtures in moe/testdata: run bench/peers/make_moe_fixtures.py on the GPU machine and commit its output under moe/testdata/")
	}
	dirs := make([]string, len(cjs))
	for i, cj := range cjs {
		dirs[i] = filepath.Dir(cj)
	}
	return dirs
}

func checkFixture(t *testing.T, dir string) {
	cfg, w, cases := loadLayerFixture(t, dir)
	K := cfg.TopK
	for _, c := range cases {
		got, err := Reference(cfg, w, c.x, c.T)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(c.y) {
			t.Fatalf("%s: %d values, expected file has %d", c.name, len(got), len(c.y))
		}
		var maxRef, maxDiff float64
		for i := range got {
			maxRef = max(maxRef, math.Abs(float64(c.y[i])))
			maxDiff = max(maxDiff, math.Abs(float64(got[i])-float64(c.y[i])))
		}
		if rel := maxDiff / maxRef; !(rel <= 1e-5) {
			t.Errorf("%s (T=%d): max|ref-hf|/max|hf| = %.3g > 1e-5", c.name, c.T, rel)
		} else {
			t.Logf("%s (T=%d): relative error %.3g", c.name, c.T, rel)
		}
		// Routing, when the fixture recorded it: same expert set per token, same weights.
		if c.idx == nil {
			continue
		}
		idx, wt, err := Route(cfg, w, c.x, c.T)
		if err != nil {
			t.Fatal(err)
		}
		if len(c.idx) != c.T*K || len(c.wt) != c.T*K {
			t.Fatalf("%s: %d indices, %d weights, want %d", c.name, len(c.idx), len(c.wt), c.T*K)
		}
		for tk := 0; tk < c.T; tk++ {
			hf := map[int64]float32{}
			for k := 0; k < K; k++ {
				hf[c.idx[tk*K+k]] = c.wt[tk*K+k]
			}
			for k := 0; k < K; k++ {
				hw, ok := hf[int64(idx[tk*K+k])]
				if !ok {
					t.Fatalf("token %d: Route chose %v, transformers %v", tk, idx[tk*K:(tk+1)*K], c.idx[tk*K:(tk+1)*K])
				}
				if d := math.Abs(float64(hw) - float64(wt[tk*K+k])); d > 1e-5*math.Max(1, math.Abs(float64(hw))) {
					t.Fatalf("token %d expert %d: weight %v, transformers %v", tk, idx[tk*K+k], wt[tk*K+k], hw)
				}
			}
		}
	}
}

// fixtureCase is one input of a fixture with the block's output and, when the
// generator recorded them, its top-k indices and weights.
type fixtureCase struct {
	name string
	x, y []float32
	T    int
	idx  []int64
	wt   []float32
}

// loadLayerFixture reads a fixture directory: config, the layer's weights (the
// layer named in meta.json, else 1) and every input x<suffix> with its y<suffix>.
func loadLayerFixture(t *testing.T, dir string) (*Config, *Weights, []fixtureCase) {
	t.Helper()
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
	var cases []fixtureCase
	for _, name := range in.Header.Names() {
		if !strings.HasPrefix(name, "x") {
			continue
		}
		suffix := strings.TrimPrefix(name, "x")
		x, info, err := in.Float32(name)
		if err != nil {
			t.Fatal(err)
		}
		if len(info.Shape) != 2 || info.Shape[1] != cfg.HiddenSize {
			t.Fatalf("%s has shape %v, want [T,%d]", name, info.Shape, cfg.HiddenSize)
		}
		y, _, err := exp.Float32("y" + suffix)
		if err != nil {
			t.Fatal(err)
		}
		c := fixtureCase{name: name, x: x, y: y, T: info.Shape[0]}
		if _, ok := exp.Info("topk_idx" + suffix); ok {
			c.idx = readInts(t, exp, "topk_idx"+suffix)
			if c.wt, _, err = exp.Float32("topk_weight" + suffix); err != nil {
				t.Fatal(err)
			}
		}
		cases = append(cases, c)
	}
	if len(cases) == 0 {
		t.Fatalf("%s/input.safetensors has no tensor named x*", dir)
	}
	return cfg, w, cases
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
