package moe_test

import (
	"fmt"
	"log"
	"math"
	"path/filepath"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// Load one MoE layer of a Hugging Face checkpoint directory (config.json and
// model.safetensors; here a tiny DeepSeek-V2 fixture recorded from
// transformers), run it in Dual mode (the shared expert on a side stream) on
// the CPU backend, and compare the result with the one transformers computed.
func ExampleNewLayer() {
	dir := filepath.Join("testdata", "deepseek_v2_group_fused_bf16")
	cfg, err := moe.LoadConfig(dir) // config.json
	if err != nil {
		log.Fatal(err)
	}
	const layer = 1 // the one MoE layer this small fixture holds
	if err := cfg.CheckMoELayer(layer); err != nil {
		log.Fatal(err)
	}
	w, err := moe.LoadWeights(dir, cfg, layer) // that layer's tensors, as f32 on the host
	if err != nil {
		log.Fatal(err)
	}

	rt, err := gpuctx.OpenBackend("cpu") // "auto" picks CUDA where it loads
	if err != nil {
		log.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		log.Fatal(err)
	}
	l, err := moe.NewLayer(dev, cfg, w, moe.LayerOptions{DType: gpuctx.F32, Mode: moe.Dual})
	if err != nil {
		log.Fatal(err)
	}
	defer l.Close()

	// Activations x [tokens, hidden_size], row-major float32.
	in, err := safetensors.Open(filepath.Join(dir, "input.safetensors"))
	if err != nil {
		log.Fatal(err)
	}
	defer in.Close()
	x, info, err := in.Float32("x")
	if err != nil {
		log.Fatal(err)
	}
	T := info.Shape[0]
	y, err := l.Forward(x, T) // uploads x, runs the layer, waits, downloads y
	if err != nil {
		log.Fatal(err)
	}

	exp, err := safetensors.Open(filepath.Join(dir, "expected.safetensors"))
	if err != nil {
		log.Fatal(err)
	}
	defer exp.Close()
	want, _, err := exp.Float32("y")
	if err != nil {
		log.Fatal(err)
	}
	var sum, maxErr float64
	for i := range y {
		sum += float64(y[i])
		maxErr = max(maxErr, math.Abs(float64(y[i]-want[i])))
	}
	fmt.Printf("%s layer %d, mode %s: y[%d×%d]\n", cfg.Family, layer, moe.Dual, T, cfg.HiddenSize)
	fmt.Printf("sum of y %.2f; within 1e-5 of transformers: %v\n", sum, maxErr < 1e-5)
	// Output:
	// deepseek_v2 layer 1, mode dual: y[7×64]
	// sum of y -1.35; within 1e-5 of transformers: true
}
