package moe

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// variants are small configs covering every family and routing variant.
func variants() map[string]*Config {
	base := func(f Family) *Config {
		return &Config{Family: f, HiddenSize: 16, NumExperts: 8, TopK: 3, Intermediate: 8,
			Scoring: Softmax, TopKMethod: Greedy, NumGroups: 1, TopKGroups: 1, RoutedScalingFactor: 1,
			HiddenAct: "silu", NumHiddenLayers: 2, MoELayerFreq: 1, DecoderSparseStep: 1}
	}
	v2 := base(DeepseekV2)
	v2.SharedIntermediate, v2.RoutedScalingFactor = 16, 1.5
	v2g := *v2
	v2g.TopKMethod, v2g.NumGroups, v2g.TopKGroups = GroupLimitedGreedy, 4, 2
	v3 := base(DeepseekV3)
	v3.SharedIntermediate, v3.Scoring, v3.TopKMethod, v3.NumGroups, v3.TopKGroups = 8, Sigmoid, NoAuxTC, 4, 2
	v3.NormTopKProb, v3.RoutedScalingFactor = true, 2.5
	v3n := *v3
	v3n.NormTopKProb = false
	q2 := base(Qwen2MoE)
	q2.SharedIntermediate, q2.SharedGate = 24, true
	q2n := *q2
	q2n.NormTopKProb = true
	q3 := base(Qwen3MoE)
	q3.NormTopKProb = true
	mx := base(Mixtral)
	mx.TopK, mx.NormTopKProb = 2, true
	return map[string]*Config{
		"deepseek_v2_greedy": v2, "deepseek_v2_group": &v2g, "deepseek_v3": v3, "deepseek_v3_nonorm": &v3n,
		"qwen2_moe": q2, "qwen2_moe_norm": &q2n, "qwen3_moe": q3, "mixtral": mx,
	}
}

func writeCheckpoint(t *testing.T, dir string, tensors []safetensors.Tensor, shards int) {
	t.Helper()
	if shards <= 1 {
		if err := safetensors.Write(filepath.Join(dir, "model.safetensors"), tensors, map[string]string{"format": "pt"}); err != nil {
			t.Fatal(err)
		}
		return
	}
	wm := map[string]string{}
	per := (len(tensors) + shards - 1) / shards
	for s := 0; s < shards; s++ {
		lo, hi := s*per, min((s+1)*per, len(tensors))
		name := fmt.Sprintf("model-%05d-of-%05d.safetensors", s+1, shards)
		if err := safetensors.Write(filepath.Join(dir, name), tensors[lo:hi], nil); err != nil {
			t.Fatal(err)
		}
		for _, tn := range tensors[lo:hi] {
			wm[tn.Name] = name
		}
	}
	js, _ := json.Marshal(map[string]any{"metadata": map[string]any{}, "weight_map": wm})
	if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), js, 0o644); err != nil {
		t.Fatal(err)
	}
}

// rounded returns w with every value rounded through dt, as a file of dt holds it.
func rounded(t *testing.T, cfg *Config, w *Weights, dt DType) *Weights {
	t.Helper()
	ts, err := LayerTensors(cfg, w, 0, Fused, dt)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	writeCheckpoint(t, dir, ts, 1)
	c := *cfg
	c.NumHiddenLayers, c.FirstKDenseReplace = 0, 0
	r, err := LoadWeights(dir, &c, 0)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestLoadWeightsRoundTrip(t *testing.T) {
	type tc struct {
		variant string
		layout  Layout
		dt      DType
		shards  int
	}
	var cases []tc
	for v := range variants() {
		cases = append(cases, tc{v, PerExpert, safetensors.F32, 1}, tc{v, Fused, safetensors.BF16, 3})
	}
	cases = append(cases,
		tc{"deepseek_v3", PerExpert, safetensors.F16, 4},
		tc{"deepseek_v2_group", Fused, safetensors.F32, 1},
		tc{"qwen2_moe", PerExpert, safetensors.BF16, 2},
		tc{"mixtral", MixtralHub, safetensors.F32, 1},
		tc{"mixtral", MixtralHub, safetensors.BF16, 5},
	)
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s/%d/%s/%dshards", c.variant, c.layout, c.dt, c.shards), func(t *testing.T) {
			cfg := variants()[c.variant]
			w, err := RandomWeights(cfg, 7)
			if err != nil {
				t.Fatal(err)
			}
			ts, err := LayerTensors(cfg, w, 1, c.layout, c.dt)
			if err != nil {
				t.Fatal(err)
			}
			// A decoy layer 0 in the same files must not be picked up.
			decoy, _ := RandomWeights(cfg, 8)
			ts0, _ := LayerTensors(cfg, decoy, 0, c.layout, c.dt)
			dir := t.TempDir()
			writeCheckpoint(t, dir, append(ts0, ts...), c.shards)
			got, err := LoadWeights(dir, cfg, 1)
			if err != nil {
				t.Fatal(err)
			}
			if got.DType != c.dt {
				t.Errorf("DType = %s, want %s", got.DType, c.dt)
			}
			if err := got.Check(cfg); err != nil {
				t.Fatal(err)
			}
			want := w
			if c.dt != safetensors.F32 {
				want = rounded(t, cfg, w, c.dt)
			}
			want.DType, want.DTypes = got.DType, got.DTypes
			if !reflect.DeepEqual(got, want) {
				t.Fatal("loaded weights differ from the written ones")
			}
			if c.dt == safetensors.BF16 {
				// ToBF16 gives back the file's bits exactly.
				for _, tn := range ts {
					if tn.Name == LayerPrefix(1, c.layout)+"gate.weight" {
						bits := ToBF16(got.Router)
						for i, b := range bits {
							if fb := uint16(tn.Data[2*i]) | uint16(tn.Data[2*i+1])<<8; fb != b {
								t.Fatalf("router bf16 %d: %#x, file has %#x", i, b, fb)
							}
						}
					}
				}
			}
		})
	}
}

func TestRandomWeightsDeterministic(t *testing.T) {
	cfg := variants()["deepseek_v3"]
	a, _ := RandomWeights(cfg, 1)
	b, _ := RandomWeights(cfg, 1)
	c, _ := RandomWeights(cfg, 2)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same seed, different weights")
	}
	if reflect.DeepEqual(a.Experts[0].Gate, c.Experts[0].Gate) {
		t.Fatal("different seeds, same weights")
	}
	bound := float32(1 / 4.0) // 1/sqrt(H=16)
	for _, v := range a.Experts[3].Up {
		if v < -bound || v > bound {
			t.Fatalf("value %v outside +-%v", v, bound)
		}
	}
	if _, err := RandomWeights(&Config{}, 1); err == nil {
		t.Fatal("invalid config: want error")
	}
}

// dropTensor returns ts without the tensor called name.
func dropTensor(ts []safetensors.Tensor, name string) []safetensors.Tensor {
	var out []safetensors.Tensor
	for _, x := range ts {
		if x.Name != name {
			out = append(out, x)
		}
	}
	return out
}

// replaceTensor returns ts with x in place of the tensor of x's name.
func replaceTensor(ts []safetensors.Tensor, x safetensors.Tensor) []safetensors.Tensor {
	return append(dropTensor(ts, x.Name), x)
}

func TestLoadWeightsErrors(t *testing.T) {
	cfg := variants()["qwen2_moe"]
	v3 := variants()["deepseek_v3"]
	w, _ := RandomWeights(cfg, 1)
	w3, _ := RandomWeights(v3, 1)
	good, err := LayerTensors(cfg, w, 1, PerExpert, safetensors.F32)
	if err != nil {
		t.Fatal(err)
	}
	good3, _ := LayerTensors(v3, w3, 1, Fused, safetensors.F32)
	p := "model.layers.1.mlp."
	badShape, _ := safetensors.FromFloat32(p+"experts.3.down_proj.weight", safetensors.F32, []int{8, 16}, make([]float32, 128))
	badDType, _ := safetensors.FromInt32(p+"gate.weight", []int{8, 16}, make([]int32, 128))
	badFused, _ := safetensors.FromFloat32(p+"experts.gate_up_proj", safetensors.F32, []int{8, 32, 8}, make([]float32, 8*32*8))
	cases := []struct {
		name    string
		cfg     *Config
		tensors []safetensors.Tensor
		layer   int
		want    string
	}{
		{"missing expert", cfg, dropTensor(good, p+"experts.5.up_proj.weight"), 1, "tensor model.layers.1.mlp.experts.5.up_proj.weight (shape [8 16] expected) is missing"},
		{"missing router", cfg, dropTensor(good, p+"gate.weight"), 1, "model.layers.1.mlp.gate.weight (shape [8 16] expected) is missing"},
		{"missing shared gate", cfg, dropTensor(good, p+"shared_expert_gate.weight"), 1, "shared_expert_gate.weight (shape [1 16] expected)"},
		{"missing shared", cfg, dropTensor(good, p+"shared_expert.down_proj.weight"), 1, "shared_expert.down_proj.weight (shape [16 24] expected)"},
		{"missing bias", v3, dropTensor(good3, p+"gate.e_score_correction_bias"), 1, "gate.e_score_correction_bias (shape [8] expected)"},
		{"wrong shape", cfg, replaceTensor(good, badShape), 1, "experts.3.down_proj.weight has shape [8 16], expected [16 8]"},
		{"wrong fused shape", v3, replaceTensor(good3, badFused), 1, "experts.gate_up_proj has shape [8 32 8], expected [8 16 16]"},
		{"bad dtype", cfg, replaceTensor(good, badDType), 1, "gate.weight has dtype I32"},
		{"wrong layer", cfg, good, 0, "(shape [8 16] expected) is missing"},
		{"layer out of range", cfg, good, 2, "out of range"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			writeCheckpoint(t, dir, c.tensors, 1)
			_, err := LoadWeights(dir, c.cfg, c.layer)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v\nwant it to contain %q", err, c.want)
			}
		})
	}

	t.Run("dense layer", func(t *testing.T) {
		d := *variants()["deepseek_v2_greedy"]
		d.FirstKDenseReplace = 1
		_, err := LoadWeights(t.TempDir(), &d, 0)
		if err == nil || !strings.Contains(err.Error(), "dense MLP layer") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("no files", func(t *testing.T) {
		_, err := LoadWeights(t.TempDir(), cfg, 1)
		if err == nil || !strings.Contains(err.Error(), "no model.safetensors") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("bad index", func(t *testing.T) {
		for _, idx := range []string{`{`, `{"weight_map":{}}`, `{"weight_map":{"a":"../x.safetensors"}}`} {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), []byte(idx), 0o644); err != nil {
				t.Fatal(err)
			}
			if _, err := LoadWeights(dir, cfg, 1); err == nil {
				t.Fatalf("index %s: want error", idx)
			}
		}
	})
	t.Run("missing shard", func(t *testing.T) {
		dir := t.TempDir()
		writeCheckpoint(t, dir, good, 3)
		if err := os.Remove(filepath.Join(dir, "model-00002-of-00003.safetensors")); err != nil {
			t.Fatal(err)
		}
		_, err := LoadWeights(dir, cfg, 1)
		if err == nil || !strings.Contains(err.Error(), "model-00002-of-00003.safetensors") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("corrupt file", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "model.safetensors"), []byte("not a safetensors file"), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadWeights(dir, cfg, 1); err == nil {
			t.Fatal("want error")
		}
	})
	t.Run("invalid config", func(t *testing.T) {
		if _, err := LoadWeights(t.TempDir(), &Config{Family: Qwen3MoE}, 0); err == nil {
			t.Fatal("want error")
		}
	})
	t.Run("tensor names", func(t *testing.T) {
		dir := t.TempDir()
		writeCheckpoint(t, dir, good, 2)
		names, err := TensorNames(dir, 1)
		if err != nil || len(names) != len(good) {
			t.Fatalf("TensorNames = %d names, %v; want %d", len(names), err, len(good))
		}
	})
}

func TestWeightsCheck(t *testing.T) {
	cfg := variants()["qwen2_moe"]
	mk := func(f func(w *Weights)) *Weights {
		w, _ := RandomWeights(cfg, 3)
		f(w)
		return w
	}
	cases := []struct {
		name string
		w    *Weights
		want string
	}{
		{"nil", nil, "nil *Weights"},
		{"router", mk(func(w *Weights) { w.Router = w.Router[1:] }), "router has 127 values"},
		{"experts", mk(func(w *Weights) { w.Experts = w.Experts[:7] }), "7 experts, want 8"},
		{"expert shape", mk(func(w *Weights) { w.Experts[2].Down = nil }), "expert 2"},
		{"no shared", mk(func(w *Weights) { w.Shared = nil }), "shared expert present=false"},
		{"no shared gate", mk(func(w *Weights) { w.SharedGate = nil }), "shared expert gate"},
		{"unexpected bias", mk(func(w *Weights) { w.Bias = make([]float32, 8) }), "correction bias"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.w.Check(cfg)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want %q", err, c.want)
			}
		})
	}
	w, _ := RandomWeights(cfg, 3)
	if _, err := LayerTensors(cfg, w, 0, MixtralHub, safetensors.F32); err == nil {
		t.Fatal("MixtralHub for qwen2_moe: want error")
	}
	if _, err := LayerTensors(cfg, w, 0, Layout(9), safetensors.F32); err == nil {
		t.Fatal("unknown layout: want error")
	}
}
