// Package moe holds the host side of gpuctx's Mixture-of-Experts workload: the
// layer configuration read from a Hugging Face config.json (LoadConfig, Preset),
// one layer's weights read from safetensors checkpoints (LoadWeights) or drawn at
// random for benchmarks (RandomWeights), and a float64 host reference of the
// router (Route) and of the whole block (Reference) with the exact semantics of
// the transformers 5.x MoE blocks of DeepSeek-V2, DeepSeek-V3, Qwen2-MoE
// (Qwen1.5-MoE), Qwen3-MoE and Mixtral.
//
// Layer is the device forward: NewLayer uploads a layer's weights to a gpuctx
// Device, and Layer.ForwardDevice queues the router, the routing and
// permutation (or the block-aligned sort), the routed experts (small-batch
// kernels, grouped GEMMs, or the fused tile kernels), SwiGLU and the combine
// on the layer's main stream, with the shared expert on the same stream
// (Single), on a side stream forked and joined with events (Dual), or inside
// the fused kernels (FusedShared). Each forward is planned first, then run by
// one executor over stages that own their buffers (see ARCHITECTURE.md); an
// ExpertShard runs the same stages around a collective.Comm. Its doc comments
// say which stream each call uses and what it waits for.
//
// FP8 checkpoints (DeepSeek-V3/R1, Qwen3-FP8: config.json's
// quantization_config, Config.Quant; package moe/fp8) load dequantized into
// f32 and bf16 layers, or with LayerOptions.FP8 keep the routed experts' E4M3
// codes and 128x128 block scales on the device, run by weight-only FP8 tiles
// (w8a16), or for large batches on compute capability 9.0 by FP8 x FP8 tiles
// (w8a8) over activations quantized on the device; FusedShared then runs
// the shared expert's chunks in FP8 too, in the w8a16 tiles.
//
// Everything else in this package runs on the host, on the calling goroutine
// (some functions fan out over worker goroutines and wait for them). Config and Weights are plain data: once built
// they are safe to read from many goroutines, and the device forward may keep
// pointers to them as long as nobody mutates them.
//
// Weights layout: every matrix is row-major [out][in], the nn.Linear layout of
// the checkpoint. Router is [E][H]; each Expert has Gate and Up [I][H] and Down
// [H][I]; the shared expert has the same shape with its own width.
package moe
