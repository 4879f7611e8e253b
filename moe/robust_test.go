package moe

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// within fails the test when f does not return within 5 s (an unbounded loop).
func within(t *testing.T, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("still running after 5s")
	}
}

// TestConfigRanges: absurd sizes are refused by ParseConfig with the field, the
// value and the limit, before anything is allocated or looped over.
func TestConfigRanges(t *testing.T) {
	cases := []struct{ name, json, want string }{
		{"experts 1e9", `{"model_type":"deepseek_v3","n_routed_experts":1000000000}`, "n_routed_experts = 1000000000"},
		{"experts over MaxExperts", `{"model_type":"qwen3_moe","num_experts":513}`, "at most 512"},
		{"top-k over MaxTopK", `{"model_type":"qwen3_moe","num_experts":64,"num_experts_per_tok":17}`, "num_experts_per_tok = 17"},
		{"hidden 1e9", `{"model_type":"qwen3_moe","hidden_size":1000000000}`, "hidden_size = 1000000000"},
		{"intermediate 1e9", `{"model_type":"qwen3_moe","moe_intermediate_size":1000000000}`, "moe_intermediate_size = 1000000000"},
		{"mixtral intermediate 1e9", `{"model_type":"mixtral","intermediate_size":1000000000}`, "intermediate_size = 1000000000"},
		{"mixtral intermediate 200000", `{"model_type":"mixtral","intermediate_size":200000}`, "for mixtral's experts"},
		{"shared 1e9", `{"model_type":"qwen2_moe","shared_expert_intermediate_size":1000000000}`, "shared_expert_intermediate_size = 1000000000"},
		{"n_shared 1e6", `{"model_type":"deepseek_v3","n_shared_experts":1000000}`, "n_shared_experts = 1000000"},
		{"layers 1e12", `{"model_type":"qwen3_moe","num_hidden_layers":1000000000000}`, "num_hidden_layers = 1000000000000"},
		{"first_k_dense 1e15", `{"model_type":"deepseek_v3","first_k_dense_replace":1000000000000000}`, "first_k_dense_replace = 1000000000000000"},
		{"first_k_dense beyond layers", `{"model_type":"deepseek_v3","num_hidden_layers":4,"first_k_dense_replace":4}`, "no MoE layer"},
		{"sparse step 1e15", `{"model_type":"qwen3_moe","decoder_sparse_step":1000000000000000}`, "decoder_sparse_step = 1000000000000000"},
		{"moe_layer_freq 1e15", `{"model_type":"deepseek_v3","moe_layer_freq":1000000000000000}`, "moe_layer_freq = 1000000000000000"},
		{"mlp_only_layers", `{"model_type":"qwen3_moe","mlp_only_layers":[-1]}`, "mlp_only_layers"},
		{"n_group 1e9", `{"model_type":"deepseek_v3","n_group":1000000000}`, "n_group = 1000000000"},
		{"scale", `{"model_type":"deepseek_v3","routed_scaling_factor":-1}`, "routed_scaling_factor"},
		{"string field", `{"model_type":"qwen3_moe","hidden_size":"64"}`, `hidden_size is a string, expected an integer`},
		{"float field", `{"model_type":"qwen3_moe","num_experts":8.5}`, `num_experts is the number 8.5, expected an integer`},
		{"list field", `{"model_type":"qwen3_moe","mlp_only_layers":"1"}`, `mlp_only_layers is a string, expected a list of integers`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var err error
			within(t, func() {
				var cfg *Config
				cfg, err = ParseConfig([]byte(c.json))
				if err == nil {
					_, _ = cfg.FirstMoELayer()
				}
			})
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v, want it to contain %q", err, c.want)
			}
			if strings.Contains(err.Error(), "not valid JSON") {
				t.Errorf("err = %v: the file is valid JSON", err)
			}
		})
	}
}

// TestFirstMoELayerBounded: FirstMoELayer ends quickly for any Config, valid or
// not (it is also called on hand-made Configs).
func TestFirstMoELayerBounded(t *testing.T) {
	for _, c := range []*Config{
		{Family: DeepseekV3, FirstKDenseReplace: 1e15, MoELayerFreq: 1, DecoderSparseStep: 1},
		{Family: Qwen3MoE, DecoderSparseStep: 1e15, MoELayerFreq: 1},
		{Family: Qwen3MoE, NumHiddenLayers: 1e12, DecoderSparseStep: 2, MoELayerFreq: 1, MLPOnlyLayers: []int{1, 3, 5}},
	} {
		within(t, func() { _, _ = c.FirstMoELayer() })
	}
}

func TestCheckTokens(t *testing.T) {
	cfg := variants()["qwen2_moe"]
	if err := cfg.CheckTokens(1000); err != nil {
		t.Fatal(err)
	}
	for _, T := range []int{0, -1} {
		if err := cfg.CheckTokens(T); err == nil || !strings.Contains(err.Error(), "no tokens") {
			t.Errorf("T=%d: err = %v", T, err)
		}
	}
	big := *cfg
	big.Intermediate = 1 << 17
	if err := big.CheckTokens(1 << 13); err == nil || !strings.Contains(err.Error(), "32-bit") {
		t.Errorf("T over the 32-bit limit: err = %v", err)
	}
}

func TestLoadConfigFIFO(t *testing.T) {
	dir := t.TempDir()
	if err := syscall.Mkfifo(filepath.Join(dir, "config.json"), 0o600); err != nil {
		t.Skip(err)
	}
	var err error
	within(t, func() { _, err = LoadConfig(dir) })
	if err == nil || !strings.Contains(err.Error(), "named pipe") {
		t.Fatalf("err = %v", err)
	}
}

// writeIndex writes model.safetensors.index.json with the given weight map.
func writeIndex(t *testing.T, dir string, wm map[string]string) {
	t.Helper()
	js, _ := json.Marshal(map[string]any{"weight_map": wm})
	if err := os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), js, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCheckpointIndexErrors(t *testing.T) {
	cfg := variants()["qwen2_moe"]
	w, _ := RandomWeights(cfg, 1)
	ts, err := LayerTensors(cfg, w, 1, PerExpert, safetensors.F32)
	if err != nil {
		t.Fatal(err)
	}
	t.Run("dotdot", func(t *testing.T) {
		dir := t.TempDir()
		for _, bad := range []string{"..", ".", "a/b.safetensors", `..\x`, "/etc/passwd"} {
			writeIndex(t, dir, map[string]string{"model.layers.1.mlp.gate.weight": bad})
			_, err := LoadWeights(dir, cfg, 1)
			if err == nil || !strings.Contains(err.Error(), "plain file name") {
				t.Errorf("shard %q: err = %v", bad, err)
			}
		}
	})
	t.Run("missing shard", func(t *testing.T) {
		dir := t.TempDir()
		writeCheckpoint(t, dir, ts, 3)
		if err := os.Remove(filepath.Join(dir, "model-00001-of-00003.safetensors")); err != nil {
			t.Fatal(err)
		}
		_, err := LoadWeights(dir, cfg, 1)
		if err == nil || !strings.Contains(err.Error(), "shard model-00001-of-00003.safetensors") || strings.Contains(err.Error(), "is missing from") {
			t.Fatalf("err = %v, want it to name the missing shard", err)
		}
	})
	t.Run("shard is a FIFO", func(t *testing.T) {
		dir := t.TempDir()
		writeCheckpoint(t, dir, ts, 3)
		p := filepath.Join(dir, "model-00001-of-00003.safetensors")
		_ = os.Remove(p)
		if err := syscall.Mkfifo(p, 0o600); err != nil {
			t.Skip(err)
		}
		var err error
		within(t, func() { _, err = LoadWeights(dir, cfg, 1) })
		if err == nil || !strings.Contains(err.Error(), "named pipe") {
			t.Fatalf("err = %v", err)
		}
	})
	t.Run("checkpoint files", func(t *testing.T) {
		dir := t.TempDir()
		writeCheckpoint(t, dir, ts, 2)
		files, err := CheckpointFiles(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(files) != 3 || filepath.Base(files[0]) != "model.safetensors.index.json" {
			t.Fatalf("files = %v", files)
		}
	})
}

// TestMoELayersInCheckpoint: the layers are found from the tensor names, whatever
// num_hidden_layers says.
func TestMoELayersInCheckpoint(t *testing.T) {
	cfg := *variants()["qwen2_moe"]
	w, _ := RandomWeights(&cfg, 1)
	ts, _ := LayerTensors(&cfg, w, 3, PerExpert, safetensors.F32)
	dir := t.TempDir()
	writeCheckpoint(t, dir, ts, 1)
	cfg.NumHiddenLayers = MaxLayers
	var layers []int
	var err error
	within(t, func() { layers, err = MoELayersInCheckpoint(dir, &cfg) })
	if err != nil || len(layers) != 1 || layers[0] != 3 {
		t.Fatalf("layers = %v, err = %v", layers, err)
	}
	empty := t.TempDir()
	writeCheckpoint(t, empty, []safetensors.Tensor{mustTensor(t, "lm_head.weight")}, 1)
	within(t, func() { layers, err = MoELayersInCheckpoint(empty, &cfg) })
	if err != nil || len(layers) != 0 {
		t.Fatalf("no MoE tensors: layers = %v, err = %v", layers, err)
	}
}

func mustTensor(t *testing.T, name string) safetensors.Tensor {
	ts, err := safetensors.FromFloat32(name, safetensors.F32, []int{1}, []float32{1})
	if err != nil {
		t.Fatal(err)
	}
	return ts
}
