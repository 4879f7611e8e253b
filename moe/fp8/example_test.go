package fp8_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/gpuctx/gpuctx/moe/fp8"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// Example writes a one-projection FP8 checkpoint in the Hub's format and
// loads it back as a loader does: the config's quantization_config, then the
// weight and its block scales, dequantized for an f32 run.
func Example() {
	dir, err := os.MkdirTemp("", "fp8-example")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)

	// Write: a [2, 3] gate_proj from f32 weights.
	const name = "model.layers.3.mlp.experts.0.gate_proj.weight"
	w, _ := safetensors.FromFloat32(name, safetensors.F32, []int{2, 3}, []float32{1, -2, 0.5, 448, 3, -0.25})
	cfg := []byte(`{"model_type": "deepseek_v3"}`)
	if err := fp8.WriteCheckpoint(dir, cfg, []safetensors.Tensor{w}, fp8.HubQuantConfig(), nil); err != nil {
		fmt.Println(err)
		return
	}

	// Load: the quantization_config, then the tensors.
	data, _ := os.ReadFile(filepath.Join(dir, "config.json"))
	var c struct {
		Quant json.RawMessage `json:"quantization_config"`
	}
	_ = json.Unmarshal(data, &c)
	q, err := fp8.ParseQuantConfig(c.Quant)
	if err != nil {
		fmt.Println(err)
		return
	}
	f, err := safetensors.Open(filepath.Join(dir, "model.safetensors"))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer f.Close()
	for _, n := range f.Header.Names() {
		ti, _ := f.Info(n)
		fmt.Println(n, ti.DType, ti.Shape)
	}
	fw, err := fp8.ReadWeight(f, name, 2, 3, q)
	if err != nil {
		fmt.Println(err)
		return
	}
	deq, _ := fw.Dequantize()
	fmt.Println(fw.Scales, deq)
	// Output:
	// model.layers.3.mlp.experts.0.gate_proj.weight F8_E4M3 [2 3]
	// model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv F32 [1 1]
	// [1] [1 -2 0.5 448 3 -0.25]
}

// ExampleParseQuantConfig shows the one-line error for a configuration the
// package does not support.
func ExampleParseQuantConfig() {
	_, err := fp8.ParseQuantConfig(json.RawMessage(`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}`))
	fmt.Println(err)
	// Output:
	// fp8: ParseQuantConfig: quantization_config.weight_block_size = [64,64] is not supported; want [128, 128] (the block of the FP8 kernels)
}
