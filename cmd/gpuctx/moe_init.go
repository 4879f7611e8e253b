package main

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpuctx/gpuctx/internal/atomicfile"
	"github.com/gpuctx/gpuctx/internal/sysmem"
	"github.com/gpuctx/gpuctx/moe"
	"github.com/gpuctx/gpuctx/moe/fp8"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// moeInitOpts are the flags of moe init.
type moeInitOpts struct {
	preset, dir, dtype string
	seed               uint64
	tokens             int
	small              bool
}

func newMoeInitCmd(a *app) *cobra.Command {
	var o moeInitOpts
	cmd := &cobra.Command{
		Use:   "init --dir DIR [--preset NAME]",
		Short: "Write a checkpoint of one MoE layer with random weights, and an input, for moe run",
		Long: `moe init writes a Hugging Face-style checkpoint of one MoE layer of a preset
(config.json and model.safetensors, the tensors named as on the Hub) with
random weights, and input.safetensors holding x [tokens, hidden_size], so that
moe run has a real model directory to read without downloading one:

    gpuctx moe init --preset deepseek-v2-lite --dir /tmp/dsv2
    gpuctx moe run --model /tmp/dsv2 --input /tmp/dsv2/input.safetensors --output /tmp/y.safetensors -v

The checkpoint holds the preset's first MoE layer and the config says it has
that many layers plus one. --small writes the shape moe bench uses on the CPU
backend (H=256, E=16, I=64) instead of the full one. DIR is created when
missing; files already in it are never overwritten.

--dtype fp8 writes the checkpoint in the Hub's FP8 format (DeepSeek-V3/R1,
Qwen3-FP8): config.json with its quantization_config (fp8, e4m3, dynamic,
128x128 blocks), every expert and shared-expert projection as F8_E4M3 with its
F32 weight_scale_inv, the router as BF16 and the correction bias as F32; x is
bf16. moe run --dtype fp8 runs it as stored, --dtype bf16 or f32 dequantized.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return a.runMoeInit(o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.preset, "preset", "deepseek-v2-lite", "layer shape: "+strings.Join(moe.PresetNames(), ", "))
	f.StringVar(&o.dir, "dir", "", "directory to write config.json, model.safetensors and input.safetensors into (required)")
	f.StringVar(&o.dtype, "dtype", "bf16", "dtype of the weights and x on disk: bf16, f32, or fp8 (the Hub's block-scaled FP8 format; x in bf16)")
	f.Uint64Var(&o.seed, "seed", 1, "seed of the random weights and input")
	f.IntVar(&o.tokens, "tokens", 64, "tokens in x")
	f.BoolVar(&o.small, "small", false, "the scaled-down shape of the CPU backend's moe bench (H=256, E=16, I=64)")
	return cmd
}

// moeInitFiles are the files moe init writes, in the order written.
var moeInitFiles = []string{"config.json", "model.safetensors", "input.safetensors"}

// moeInitReport is moe init's --json output.
type moeInitReport struct {
	Dir    string   `json:"dir"`
	Preset string   `json:"preset"`
	Layer  int      `json:"layer"`
	DType  string   `json:"dtype"`
	Tokens int      `json:"tokens"`
	Files  []string `json:"files"`
	Bytes  int64    `json:"weight_bytes"`
}

func (a *app) runMoeInit(o moeInitOpts) error {
	dt, cfg, layer, cj, err := o.plan()
	if err != nil {
		return err
	}
	if err := o.checkDir(cfg, dt); err != nil {
		return err
	}
	start := time.Now()
	step := func(what string) {
		if !a.json {
			fmt.Fprintf(a.errOut, "moe init: %s (%.1f s)\n", what, time.Since(start).Seconds())
		}
	}
	step(fmt.Sprintf("generating %s random weights of %s layer %d (~%s in f32)", cfg.Family, o.preset, layer, bytesText(4*float64(layerElems(cfg)))))
	ts, xt, err := o.generate(cfg, layer, dt)
	if err != nil {
		return err
	}
	var wbytes int64
	for _, t := range ts {
		wbytes += int64(len(t.Data))
	}
	meta := map[string]string{"format": "pt", "generator": "gpuctx moe init", "preset": o.preset, "seed": fmt.Sprint(o.seed)}
	writes := []func() error{
		func() error { return atomicfile.WriteFile(filepath.Join(o.dir, "config.json"), append(cj, '\n')) },
		func() error { return safetensors.Write(filepath.Join(o.dir, "model.safetensors"), ts, meta) },
		func() error {
			return safetensors.Write(filepath.Join(o.dir, "input.safetensors"), []safetensors.Tensor{xt}, meta)
		},
	}
	for i, write := range writes {
		if i == 1 {
			step(fmt.Sprintf("writing model.safetensors (%s in %s)", bytesText(float64(wbytes)), o.diskName(dt)))
		}
		if err := write(); err != nil {
			return fail("moe init: writing "+filepath.Join(o.dir, moeInitFiles[i]), "check the directory's space and permissions", err)
		}
	}
	if a.json {
		return a.jsonOut(moeInitReport{Dir: o.dir, Preset: o.preset, Layer: layer, DType: map[bool]string{true: "fp8", false: string(dt)}[o.dtype == "fp8"], Tokens: o.tokens,
			Files: moeInitFiles, Bytes: wbytes})
	}
	step("done")
	fmt.Fprintf(a.out, "wrote %s: config.json (%s, layer %d of %d), model.safetensors (%s, %s), input.safetensors (x [%d, %d])\n",
		o.dir, cfg.Family, layer, cfg.NumHiddenLayers, bytesText(float64(wbytes)), o.diskName(dt), o.tokens, cfg.HiddenSize)
	next := ""
	if o.dtype == "fp8" {
		next = " --dtype fp8"
	}
	fmt.Fprintf(a.out, "next: gpuctx moe run --model %s --input %s --output y.safetensors%s -v\n",
		o.dir, filepath.Join(o.dir, "input.safetensors"), next)
	return nil
}

// plan checks the flags and derives what moe init writes: the dtype on disk,
// the layer's config (NumHiddenLayers cut to the layer plus one), the layer
// and config.json's bytes.
func (o moeInitOpts) plan() (safetensors.DType, *moe.Config, int, []byte, error) {
	if o.dir == "" {
		return "", nil, 0, nil, fail("moe init: --dir is required", "name the directory to write the checkpoint into", nil)
	}
	var dt safetensors.DType
	switch o.dtype {
	case "bf16":
		dt = safetensors.BF16
	case "f32":
		dt = safetensors.F32
	case "fp8":
		dt = safetensors.BF16 // the tensors QuantizeTensors converts, and x
	default:
		return "", nil, 0, nil, fail(fmt.Sprintf("moe init: --dtype %q", o.dtype), "use bf16, f32 or fp8", nil)
	}
	cfg, err := moe.Preset(o.preset)
	if err != nil {
		return "", nil, 0, nil, fail(fmt.Sprintf("moe init: --preset %q is not a preset", o.preset), "use one of "+strings.Join(moe.PresetNames(), ", "), nil)
	}
	if o.small {
		if cfg, err = scaleDown(cfg); err != nil {
			return "", nil, 0, nil, err
		}
	}
	if err := cfg.CheckTokens(o.tokens); err != nil {
		return "", nil, 0, nil, fail(fmt.Sprintf("moe init: --tokens %d", o.tokens), "pass a positive token count the kernels can index", err)
	}
	layer, err := cfg.FirstMoELayer()
	if err != nil {
		return "", nil, 0, nil, fail("moe init: preset "+o.preset, "report this: every preset has an MoE layer", err)
	}
	cfg.NumHiddenLayers = layer + 1
	if o.dtype == "fp8" {
		cfg.Quant = fp8.HubQuantConfig()
	}
	cj, err := cfg.HFConfig()
	if err != nil {
		return "", nil, 0, nil, fail("moe init: writing config.json for preset "+o.preset, "report this", err)
	}
	return dt, cfg, layer, cj, nil
}

// checkDir refuses, before any work, a --dir that is a file or already holds
// a checkpoint file (nothing the user had is touched) and a preset whose
// generation would not fit in the host's available memory; then it creates
// the directory.
func (o moeInitOpts) checkDir(cfg *moe.Config, dt safetensors.DType) error {
	if st, err := os.Stat(o.dir); err == nil && !st.IsDir() {
		return fail(fmt.Sprintf("moe init: --dir %s is not a directory", o.dir), "name a new or existing directory", nil)
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fail("moe init: --dir "+o.dir, "name a directory you can write to", err)
	}
	for _, name := range append([]string{"model.safetensors.index.json"}, moeInitFiles...) {
		if _, err := os.Lstat(filepath.Join(o.dir, name)); err == nil {
			return fail(fmt.Sprintf("moe init: %s already holds %s", o.dir, name),
				"choose a new directory; moe init never overwrites files", nil)
		}
	}
	// f32 random weights, then their tensors in dtype.
	host := float64(layerElems(cfg)) * float64(4+2*dt.Size())
	if avail := sysmem.Field("MemAvailable"); avail > 0 && host > 0.9*float64(avail) {
		return fail(fmt.Sprintf("moe init: preset %s needs ~%s of host memory to generate (f32 weights, their %s tensors and the encoded file); %s is available",
			o.preset, gib(host), dt, gib(float64(avail))), "use --small or a smaller preset", nil)
	}
	if err := os.MkdirAll(o.dir, 0o755); err != nil {
		return fail("moe init: creating --dir "+o.dir, "name a directory you can write to", err)
	}
	return nil
}

// generate draws the layer's random weights and x, and returns the weights as
// the checkpoint's tensors (the Hub's names and layout) and x, both in dt.
func (o moeInitOpts) generate(cfg *moe.Config, layer int, dt safetensors.DType) ([]safetensors.Tensor, safetensors.Tensor, error) {
	w, err := moe.RandomWeights(cfg, o.seed)
	if err != nil {
		return nil, safetensors.Tensor{}, fail("moe init: generating the weights", "report this", err)
	}
	layout := moe.PerExpert
	if cfg.Family == moe.Mixtral {
		layout = moe.MixtralHub
	}
	ts, err := moe.LayerTensors(cfg, w, layer, layout, dt)
	if err != nil {
		return nil, safetensors.Tensor{}, fail("moe init: encoding the weights", "report this", err)
	}
	if cfg.Quant != nil {
		if ts, err = fp8.QuantizeTensors(ts, cfg.Quant); err != nil {
			return nil, safetensors.Tensor{}, fail("moe init: quantizing the weights to FP8", "report this", err)
		}
	}
	r := rand.New(rand.NewPCG(o.seed, 99))
	x := make([]float32, o.tokens*cfg.HiddenSize)
	for i := range x {
		x[i] = float32(4*r.Float64() - 2)
	}
	xt, err := safetensors.FromFloat32("x", dt, []int{o.tokens, cfg.HiddenSize}, x)
	if err != nil {
		return nil, safetensors.Tensor{}, fail("moe init: encoding x", "report this", err)
	}
	return ts, xt, nil
}

// diskName names the weights' format on disk: dt, or for --dtype fp8 the
// Hub's FP8 format.
func (o moeInitOpts) diskName(dt safetensors.DType) string {
	if o.dtype == "fp8" {
		return "F8_E4M3 with F32 block scales"
	}
	return string(dt)
}

// bytesText is b in GiB, or in MiB below one GiB.
func bytesText(b float64) string {
	if b < 1<<30 {
		return fmt.Sprintf("%.1f MiB", b/(1<<20))
	}
	return gib(b)
}
