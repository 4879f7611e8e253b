package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/bench"
	"github.com/gpuctx/gpuctx/collective/nccl"
	"github.com/gpuctx/gpuctx/moe"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

func init() { register(newMoeCmd) }

func newMoeCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "moe",
		Short: "Run or benchmark one Mixture-of-Experts layer (shared expert on a side stream)",
		Long: `moe runs one MoE layer (router, routed experts and shared expert) of a
Hugging Face checkpoint on the device (moe run), or times it on random or real
weights against the floor set by the device's measured copy bandwidth and GEMM
rate (moe bench). In dual mode the shared expert runs on a side stream while
the router and the routed experts run on the layer's main stream. moe init
writes a checkpoint of one layer with random weights to try them on.

Supported model_type values: deepseek_v2, deepseek_v3, qwen2_moe, qwen3_moe,
mixtral.`,
		Args: cobra.NoArgs,
		// "gpuctx moe" alone prints this help and succeeds, like "gpuctx".
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	cmd.AddCommand(newMoeRunCmd(a), newMoeBenchCmd(a), newMoeInitCmd(a))
	for _, sub := range cmd.Commands() {
		checkTileFlag(sub)
	}
	return cmd
}

// checkTileFlag makes cmd refuse, before any work, a --tile (if it has that
// flag) that names no tile of the fused expert GEMMs.
func checkTileFlag(cmd *cobra.Command) {
	f := cmd.Flags().Lookup("tile")
	if f == nil {
		return
	}
	next := cmd.PreRunE
	cmd.PreRunE = func(c *cobra.Command, args []string) error {
		if tag := f.Value.String(); tag != "" && !slices.Contains(moe.TileTags(), tag) {
			tags := moe.TileTags()
			return fail(fmt.Sprintf("--tile %q is not a tile of the fused expert GEMMs", tag),
				fmt.Sprintf("use one of the %d tags (mma.sync first; the ones with g<N> are warpgroup tiles, compute capability 9.0 only): %s", len(tags), strings.Join(tags, ", ")), nil)
		}
		if next != nil {
			return next(c, args)
		}
		return nil
	}
}

// fp8WeightOnlyHelp is the help of moe run's and moe bench's --fp8-weight-only.
const fp8WeightOnlyHelp = "with --dtype fp8: keep the activations in bf16 (the w8a16 tiles only, never the w8a8 ones that quantize them to FP8); about 1e-2 from the dequantized weights' result instead of 2-5%, slower from about 8 rows per expert"

// parseLayerDType maps --dtype to the layer's compute type: fp8 is a bf16
// layer whose routed experts are FP8 (isFP8, moe.LayerOptions.FP8).
func parseLayerDType(s string) (gpuctx.DType, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "f32":
		return gpuctx.F32, nil
	case "bf16", "fp8":
		return gpuctx.BF16, nil
	}
	return 0, fail(fmt.Sprintf("--dtype %q is not supported by the MoE layer", s), "use f32, bf16 or fp8", nil)
}

// isFP8 reports whether --dtype s asks for FP8 routed experts.
func isFP8(s string) bool { return strings.EqualFold(strings.TrimSpace(s), "fp8") }

// layerDTypeName is the dtype a report names: fp8, or dt's name.
func layerDTypeName(dt gpuctx.DType, fp8 bool) string {
	if fp8 {
		return "fp8"
	}
	return dt.String()
}

// parseModeFlag maps --mode to a moe.Mode.
func parseModeFlag(s string) (moe.Mode, error) {
	m, err := moe.ParseMode(strings.ToLower(strings.TrimSpace(s)))
	if err != nil {
		return 0, fail(fmt.Sprintf("--mode %q is not a mode", s), "use single, dual, auto or fused", nil)
	}
	return m, nil
}

// resolveModel reads dir/config.json and checks or picks the MoE layer. With
// layer == -1 (the default) it picks the first MoE layer whose router tensor the
// checkpoint holds (small test checkpoints often hold only one layer); the
// search looks only at the tensor names present, never at every layer the
// config claims. Other negative layers are refused.
func resolveModel(dir string, layer int) (*moe.Config, int, error) {
	if dir == "" {
		return nil, 0, fail("--model is required", "pass --model DIR, a directory holding config.json and model.safetensors (or its index and shards)", nil)
	}
	if layer < -1 {
		return nil, 0, fail(fmt.Sprintf("--layer %d is negative", layer), "pass a decoder layer index >= 0, or leave --layer out to use the first MoE layer the checkpoint holds", nil)
	}
	st, err := os.Stat(dir)
	if err != nil {
		return nil, 0, fail(fmt.Sprintf("model directory %q", dir), "pass --model DIR, a directory holding config.json and model.safetensors", err)
	}
	if !st.IsDir() {
		return nil, 0, fail(fmt.Sprintf("--model %q is a file, not a directory", dir), "pass the directory that holds config.json and model.safetensors", nil)
	}
	cfg, err := moe.LoadConfig(dir)
	if err != nil {
		return nil, 0, fail("reading the model config", "the directory must hold the Hugging Face config.json of a supported MoE model", err)
	}
	first, ferr := cfg.FirstMoELayer()
	if layer >= 0 {
		if err := cfg.CheckMoELayer(layer); err != nil {
			fix := "pick an MoE layer with --layer"
			if ferr == nil {
				fix = fmt.Sprintf("pick an MoE layer with --layer (the first is %d)", first)
			}
			return nil, 0, fail(fmt.Sprintf("--layer %d", layer), fix, err)
		}
		return cfg, layer, nil
	}
	if ferr != nil {
		return nil, 0, fail("choosing a layer", "this config.json describes no MoE layer", ferr)
	}
	layers, err := moe.MoELayersInCheckpoint(dir, cfg)
	if err != nil {
		return nil, 0, fail(fmt.Sprintf("reading the checkpoint in %s", dir), checkpointFix(err), err)
	}
	if len(layers) == 0 {
		return nil, 0, fail(fmt.Sprintf("the checkpoint in %s holds no MoE layer that config.json allows (no model.layers.<L>.mlp.gate.weight for an MoE layer L; the first MoE layer by config.json is %d)", dir, first),
			"check that config.json belongs to this checkpoint, or pass --layer", nil)
	}
	return cfg, layers[0], nil
}

// modelFiles lists the files of the model in dir that a run reads, for
// checkOutput.
func modelFiles(dir string) ([]readFile, error) {
	files, err := moe.CheckpointFiles(dir)
	if err != nil {
		return nil, fail(fmt.Sprintf("reading the checkpoint in %s", dir), checkpointFix(err), err)
	}
	out := []readFile{{"the model's config.json", filepath.Join(dir, "config.json")}}
	for _, f := range files {
		out = append(out, readFile{"the model's " + filepath.Base(f), f})
	}
	return out, nil
}

// loadLayerWeights loads layer's weights, turning the error into advice.
func loadLayerWeights(dir string, cfg *moe.Config, layer int) (*moe.Weights, error) {
	w, err := moe.LoadWeights(dir, cfg, layer)
	if err != nil {
		return nil, fail(fmt.Sprintf("loading the weights of layer %d from %s", layer, dir), "check that the checkpoint matches config.json and holds that layer (--layer)", err)
	}
	return w, nil
}

// loadLayerError turns a moe.LoadLayer error into advice: one that wraps a
// gpuctx error (out of memory, a kernel, the device) is about building the
// layer on the device, any other about the checkpoint.
func loadLayerError(dir string, layer int, dt gpuctx.DType, err error) error {
	if errors.Is(err, gpuctx.ErrOutOfMemory) {
		fix := "free device memory, or use a device with more"
		if dt == gpuctx.F32 {
			fix = "try --dtype bf16 (half the bytes), or " + fix
		}
		return fail("building the MoE layer on the device", fix, err)
	}
	for _, dev := range []error{gpuctx.ErrDeviceLost, gpuctx.ErrNoKernel, gpuctx.ErrUnavailable,
		gpuctx.ErrInvalid, gpuctx.ErrSize, gpuctx.ErrClosed, gpuctx.ErrFreed, gpuctx.ErrWrongDevice} {
		if errors.Is(err, dev) {
			return fail("building the MoE layer on the device", "try --dtype f32, or check 'gpuctx info'", err)
		}
	}
	fix := "check that the checkpoint matches config.json and holds that layer (--layer)"
	if errors.Is(err, safetensors.ErrMalformed) {
		fix = checkpointFix(err)
	}
	return fail(fmt.Sprintf("loading the weights of layer %d from %s", layer, dir), fix, err)
}

// checkpointFix is the advice after an error reading the checkpoint, by kind:
// a file that is there but malformed, a file that is missing, anything else.
func checkpointFix(err error) string {
	switch {
	case errors.Is(err, safetensors.ErrMalformed):
		return "that file is damaged or not a safetensors file: re-download or re-export the checkpoint"
	case errors.Is(err, fs.ErrNotExist):
		return "the directory must hold model.safetensors, or model.safetensors.index.json and its shards"
	}
	return "check the checkpoint's files (model.safetensors, or model.safetensors.index.json and its shards)"
}

// readInput reads the input activations from a safetensors file: the tensor
// named x, or the only tensor; F32, BF16 or F16; shape [T, H] with T >= 1 and
// within the kernels' limit, checked from the header before anything is decoded.
func readInput(path string, cfg *moe.Config) (x []float32, T int, name string, err error) {
	H := cfg.HiddenSize
	f, err := safetensors.Open(path)
	if err != nil {
		return nil, 0, "", fail(fmt.Sprintf("reading --input %s", path), "pass a safetensors file holding x, shaped [tokens, hidden_size]", err)
	}
	defer f.Close()
	names := f.Header.Names()
	switch {
	case len(names) == 1:
		name = names[0]
	default:
		if _, ok := f.Info("x"); !ok {
			return nil, 0, "", fail(fmt.Sprintf("--input %s has tensors %v but none named x", path, names), "name the input tensor x, or store only one tensor", nil)
		}
		name = "x"
	}
	info, _ := f.Info(name)
	switch info.DType {
	case safetensors.F32, safetensors.BF16, safetensors.F16:
	default:
		return nil, 0, "", fail(fmt.Sprintf("--input tensor %s has dtype %s", name, info.DType), "store it as F32, BF16 or F16", nil)
	}
	if len(info.Shape) != 2 {
		return nil, 0, "", fail(fmt.Sprintf("--input tensor %s has shape %v: rank %d, but it must be [tokens, hidden] (rank 2)", name, info.Shape, len(info.Shape)),
			fmt.Sprintf("pass activations shaped [tokens, %d]; flatten any batch dimensions into tokens", H), nil)
	}
	if info.Shape[1] != H {
		return nil, 0, "", fail(fmt.Sprintf("--input tensor %s has shape %v, but the model's hidden_size is %d", name, info.Shape, H),
			fmt.Sprintf("pass activations shaped [tokens, %d]", H), nil)
	}
	T = info.Shape[0]
	if err := cfg.CheckTokens(T); err != nil {
		return nil, 0, "", fail(fmt.Sprintf("--input tensor %s of %s (shape %v)", name, path, info.Shape), "", err)
	}
	x, _, err = f.Float32(name)
	if err != nil {
		return nil, 0, "", fail(fmt.Sprintf("reading --input tensor %s", name), "", err)
	}
	return x, T, name, nil
}

type moeRunOpts struct {
	model, input, output string
	layer                int
	dtype, mode          string
	trace                string
	verbose              bool
	gpus                 int
	autotune             bool
	fp8WeightOnly        bool
}

// moeRunReport is what moe run prints with --json.
type moeRunReport struct {
	Backend string `json:"backend"`
	Device  string `json:"device"`
	Model   string `json:"model"`
	Family  string `json:"model_type"`
	Layer   int    `json:"layer"`
	Input   string `json:"input"`
	Tensor  string `json:"input_tensor"`
	Output  string `json:"output"`
	Tokens  int    `json:"tokens"`
	Hidden  int    `json:"hidden_size"`
	DType   string `json:"dtype"`
	Mode    string `json:"mode"`
	// WeightBytes is the device memory of the layer's weights (FP8: the
	// codes and their block scales included).
	WeightBytes int64   `json:"weight_device_bytes"`
	LoadMS      float64 `json:"load_ms"`
	ForwardMS   float64 `json:"forward_ms"`
	// GPUs is the number of devices (--gpus); above 1 the layer ran expert
	// parallel and Mode is "expert-parallel".
	GPUs int `json:"gpus"`
	// DeviceMemory is the layer's memory after the forward
	// (moe.Layer.DeviceMemory), and MemInfoDrop how far the device's free
	// memory (Device.MemInfo) fell from before the load to after the
	// forward; one device only.
	DeviceMemory *bench.LayerMemory `json:"device_memory,omitempty"`
	MemInfoDrop  *int64             `json:"mem_info_drop_bytes,omitempty"`
}

// moeRunLong is moe run's help text.
const moeRunLong = `run loads MoE layer --layer (default: the first MoE layer) of the checkpoint in
--model (config.json plus model.safetensors, or model.safetensors.index.json and
its shards), uploads it to device 0 in --dtype, runs the layer on the tensor x
of --input (or its only tensor; [tokens, hidden_size], F32, BF16 or F16) and
writes the output as the tensor y (F32, [tokens, hidden_size]) to --output.

The output is written atomically (a temporary file renamed into place), so it is
never half-written; an existing output keeps its permissions, and a character
device such as /dev/null is written through, never replaced. --output may not
name any file the run reads (the --input file, config.json, the index or a
shard), by any path, symbolic or hard link included. --input and the model files
must be regular files. The forward time printed is the wall time of one
synchronous forward (host in, host out), including any first-call setup; the
load time is that of reading the weights onto the device (the load phase of
-v).

--trace FILE writes a timeline of the forward's device work (one track per
stream, one span per kernel, copy and BLAS call, arrows where the side stream
forks and joins) as Chrome trace-event JSON for ui.perfetto.dev. -v prints
where the wall time went (open, parse, load, compile, blas, forward, write) to
stderr; compiled kernels are cached on disk (GPUCTX_KERNEL_CACHE), so the
compile phase is long only on a machine's first run.

The layer is read straight from the checkpoint onto the device
(moe.LoadLayer): tensors whose dtype is --dtype's are copied as they are,
others are converted a chunk at a time. On a GPU the fused bf16 expert GEMMs
use rule-of-thumb tiles: timing the candidate tiles (about 150 ms on an H200,
at the first forward of each token bucket) cannot pay off in a run of one
forward, and the tile changes no output bit. --autotune times them, as a
long-lived moe.Layer does by default. With --dtype fp8 it times the FP8 tiles,
whose choice between the w8a16 and the w8a8 tiles (activations in E4M3)
changes the output, as the rule's does by the batch size.

--gpus N (N > 1) runs the layer expert parallel on devices 0..N-1 (moe.ExpertParallel):
rank r holds routed experts [r*E/N, (r+1)*E/N) and a replica of the router and
the shared expert, routes tokens [r*T/N, (r+1)*T/N), and the ranks exchange
assignment rows through an in-process collective group (host-staged copies; the
NCCL binding is package collective/nccl). The shared expert always runs on each
rank's side stream while the rows are in flight, so --mode does not apply, nor
--trace. On the CPU backend, which has one device per runtime, it opens N
runtimes. In f32 the output equals the one-device run's bitwise for batches
above the small-batch size (16 tokens on the grouped-GEMM path).

An explicit --gpus 1 on CUDA runs the layer the same way over a one-rank NCCL
communicator (collective/nccl) when libnccl.so.2 loads, to exercise the NCCL
path on one GPU; without --gpus (the default), without NCCL and with --trace it
runs the one-device layer (its --mode and fused kernels).

--dtype fp8 keeps the routed experts' weights in FP8 on the device (E4M3 codes
with their 128x128 block scales, moe.LayerOptions.FP8), run by the weight-only
FP8 tiles (bf16 activations) on the fused path; the router and correction bias
stay as stored, the shared expert is bf16 (single, dual) and FP8 chunks inside
the FP8 tiles (--mode fused; auto runs dual, or with --autotune the faster of
the two). An FP8 checkpoint (config.json's quantization_config, as
DeepSeek-V3/R1 and Qwen3-FP8 ship) loads as stored; a bf16 or f32 one is
quantized at load. With f32 or bf16, an FP8 checkpoint is dequantized at load.
fp8 runs on one device (not with --gpus above 1).

After the wall-time breakdown -v prints the device memory of the weights (for
fp8, against the same layer in bf16) and all the device memory the layer holds
after the forward (moe.Layer.DeviceMemory): weights (FP8 codes + block scales
+ bf16 rest), scratch buffers, BLAS workspaces of its streams and captured
graphs, pinned host memory; and how far the device's free memory (MemInfo)
fell from before the load to after the forward, which on the CPU backend is
exactly that total and on a GPU also holds what no buffer records (kernels'
code, library handles, graphs). --json reports them as device_memory and
mem_info_drop_bytes (one device only).`

func newMoeRunCmd(a *app) *cobra.Command {
	o := moeRunOpts{}
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run one MoE layer of a checkpoint on input activations; write the output",
		Long:  moeRunLong,
		Example: `  gpuctx moe run --model ./DeepSeek-V2-Lite --layer 1 --input x.safetensors --output y.safetensors
  gpuctx moe run --model ./DeepSeek-V2-Lite --input x.safetensors --output y.safetensors --dtype bf16 --mode dual --trace moe.json -v
  gpuctx moe run --model ./model --input x.safetensors --output y.safetensors --dtype f32 --mode dual --json
  gpuctx moe run --model ./model --input x.safetensors --output y.safetensors --gpus 2`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return a.runMoe(cmd, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.model, "model", "", "checkpoint directory: config.json and model.safetensors (required)")
	f.IntVar(&o.layer, "layer", -1, "decoder layer to run, >= 0; -1: the first MoE layer the checkpoint holds")
	f.StringVar(&o.input, "input", "", "safetensors file with x [tokens, hidden_size] (required)")
	f.StringVar(&o.output, "output", "", "safetensors file to write y [tokens, hidden_size] to (required)")
	f.StringVar(&o.dtype, "dtype", "f32", "layer compute type: f32, bf16, or fp8 (bf16 with the routed experts' weights in FP8 on the device)")
	f.StringVar(&o.mode, "mode", "auto", "mode: single, dual (shared expert on a side stream), fused (shared expert inside the fused kernels, bf16 or fp8) or auto")
	f.StringVar(&o.trace, "trace", "", traceHelp)
	f.BoolVarP(&o.verbose, "verbose", "v", false, "print a wall-time breakdown (open, parse, load, compile, blas, forward, write) and the layer's device memory to stderr")
	f.IntVar(&o.gpus, "gpus", 1, "devices to run the layer on, expert parallel when above 1 (the CPU backend opens one runtime per device)")
	f.BoolVar(&o.fp8WeightOnly, "fp8-weight-only", false, fp8WeightOnlyHelp)
	f.BoolVar(&o.autotune, "autotune", false, "time the fused expert GEMM tiles on the first forward (CUDA, bf16 or fp8) instead of picking them by rule of thumb; same output for bf16, slower one-shot run")
	return cmd
}

// check validates the flags that need no file: the dtype, the mode, --gpus
// and the paths' consistency.
func (o moeRunOpts) check() (gpuctx.DType, moe.Mode, error) {
	dt, err := parseLayerDType(o.dtype)
	if err != nil {
		return 0, 0, err
	}
	mode, err := parseModeFlag(o.mode)
	if err != nil {
		return 0, 0, err
	}
	if o.gpus < 1 {
		return 0, 0, fail(fmt.Sprintf("--gpus %d", o.gpus), "pass --gpus 1 or more", nil)
	}
	if o.fp8WeightOnly && !isFP8(o.dtype) {
		return 0, 0, fail("--fp8-weight-only without --dtype fp8", "it picks the FP8 experts' tiles: add --dtype fp8, or drop it", nil)
	}
	if o.gpus > 1 && isFP8(o.dtype) {
		return 0, 0, fail("--dtype fp8 with --gpus above 1", "the expert-parallel layer has no FP8 experts: run fp8 on one device, or use --dtype bf16", nil)
	}
	if o.gpus > 1 && o.trace != "" {
		return 0, 0, fail("--trace with --gpus above 1", "trace a one-device run (--gpus 1)", nil)
	}
	if o.input == "" || o.output == "" {
		return 0, 0, fail("--input and --output are required", "pass --input X.safetensors (holding x) and --output Y.safetensors", nil)
	}
	if sameFile(o.input, o.output) {
		return 0, 0, fail(fmt.Sprintf("--output %s is the --input file", o.output), "write the output to another file; the input is never overwritten", nil)
	}
	return dt, mode, checkOutput("--output", o.output, nil)
}

// moeRunInput is what moe run read before opening the device: the model's
// config and layer, the files the run reads, and the input x.
type moeRunInput struct {
	cfg   *moe.Config
	layer int
	reads []readFile
	x     []float32
	T     int
	name  string // x's tensor name
}

// parse reads config.json, picks the layer, checks that no output is a file
// the run reads, and reads x.
func (o moeRunOpts) parse() (*moeRunInput, error) {
	cfg, layer, err := resolveModel(o.model, o.layer)
	if err != nil {
		return nil, err
	}
	reads, err := modelFiles(o.model)
	if err != nil {
		return nil, err
	}
	reads = append(reads, readFile{"the --input file", o.input})
	if err := checkOutput("--output", o.output, reads); err != nil {
		return nil, err
	}
	if o.trace != "" {
		if sameFile(o.trace, o.output) {
			return nil, fail(fmt.Sprintf("--trace %s is the --output file", o.trace), "write the trace to another file", nil)
		}
		if err := checkOutput("--trace", o.trace, reads); err != nil {
			return nil, err
		}
	}
	x, T, name, err := readInput(o.input, cfg)
	if err != nil {
		return nil, err
	}
	return &moeRunInput{cfg: cfg, layer: layer, reads: reads, x: x, T: T, name: name}, nil
}

func (a *app) runMoe(cmd *cobra.Command, o moeRunOpts) error {
	dt, mode, err := o.check()
	if err != nil {
		return err
	}
	steps := 6 // parse, open, load, blas, forward, write; compile is charged afterwards
	if o.trace != "" {
		steps++
	}
	ph := phases{prog: newProgress(&a.errOut, "moe run", steps)}
	defer ph.prog.finish()
	start := time.Now()
	ph.begin("parse")
	in, err := o.parse()
	if err != nil {
		return err
	}
	if o.gpus > 1 {
		return a.runMoeShards(o, in, dt, start, &ph)
	}
	ph.begin("open")
	rt, dev, err := a.openDevice()
	if err != nil {
		return err
	}
	defer rt.Close()
	fp8 := isFP8(o.dtype) // FP8 runs the one-device layer (the NCCL path has no FP8 experts)
	if comm, lib := pickMoeComm(rt.Backend(), o.gpus, cmd.Flags().Changed("gpus") && !fp8, o.trace != "", nccl.Load); comm == commNCCL {
		return a.runMoeNCCL(o, moeParallelRun{rt: rt, cfg: in.cfg, layer: in.layer, x: in.x, T: in.T, name: in.name, reads: in.reads, dt: dt, start: start}, lib)
	}
	free0, _, freeErr := dev.MemInfo() // before the warm-up's buffers, freed before the forward
	waitBlas := startBlasWarmup(dev, in.cfg, in.T, dt)
	defer waitBlas()
	a.warnFullSize(dev, in.cfg, dt)
	ph.begin("load")
	k0 := dev.KernelStats()
	// With --trace the forward runs eagerly, so that its kernels show (a graph
	// replay is one span). One forward runs eagerly anyway: graphs are
	// captured from the second run of a shape.
	l, err := moe.LoadLayer(dev, o.model, in.cfg, in.layer, moe.LayerOptions{DType: dt, Mode: mode, AutoThreshold: moe.DefaultAutoThreshold,
		NoGraphs: o.trace != "", NoAutotune: !o.autotune, Tokens: []int{in.T}, FP8: fp8, FP8WeightOnly: o.fp8WeightOnly})
	if err != nil {
		return loadLayerError(o.model, in.layer, dt, err)
	}
	defer l.Close()
	k1 := dev.KernelStats()
	ph.move("load", "compile", k1.Time-k0.Time) // LoadLayer's kernel lookups
	// The CPU backend has no warm-up to wait for.
	if dev.Backend() != "cpu" {
		ph.begin("blas")
	}
	warm := waitBlas()
	y, fwd, err := a.forwardMoe(cmd, o, in, dev, l, mode, &ph)
	if err != nil {
		return err
	}
	k2 := dev.KernelStats()
	ph.move("forward", "compile", k2.Time-k1.Time) // kernels the forward looked up first (fused tiles)
	mem := newRunMemory(dev, l, free0, freeErr)
	ph.begin("write")
	if err := writeMoeOutput(o, in, dev.Backend(), dt, mode, y); err != nil {
		return err
	}
	ph.end()
	if o.verbose {
		ph.print(a.errOut, map[string]string{"compile": kernelNote(dev, k0, k2), "blas": blasNote(warm), "forward": forwardNote(dev.Backend(), dt, o.autotune, l.TunedFromCache())}, dev.Backend())
		fmt.Fprintf(a.errOut, "weights on the device: %s\n", weightMemoryText(l))
		fmt.Fprintf(a.errOut, "device memory: %s\n", mem.text())
	}
	rep := moeRunReport{Backend: dev.Backend(), Device: dev.Info().Name, Model: o.model, Family: string(in.cfg.Family), Layer: in.layer,
		Input: o.input, Tensor: in.name, Output: o.output, Tokens: in.T, Hidden: in.cfg.HiddenSize, DType: layerDTypeName(dt, fp8), Mode: mode.String(),
		WeightBytes: l.DeviceWeightBytes(), LoadMS: ms(ph.d["load"]), ForwardMS: ms(fwd), GPUs: 1, DeviceMemory: &mem.layer, MemInfoDrop: mem.drop}
	return a.printMoeRun(rep)
}

// runMemory is a layer's memory after moe run's forward, and how far the
// device's free memory fell since before the load (nil where MemInfo
// failed).
type runMemory struct {
	layer bench.LayerMemory
	drop  *int64
}

// newRunMemory reads l's memory and the device's free memory now; free0 and
// err0 are MemInfo's free bytes before the load.
func newRunMemory(dev *gpuctx.Device, l *moe.Layer, free0 uint64, err0 error) runMemory {
	m := runMemory{layer: bench.NewLayerMemory(l.DeviceMemory())}
	if free1, _, err := dev.MemInfo(); err == nil && err0 == nil {
		d := int64(free0) - int64(free1)
		m.drop = &d
	}
	return m
}

// text is -v's device memory line after "device memory: ": the layer's parts
// (bench.LayerMemory.Text) and MemInfo's fall over the load and forward,
// which on a GPU also holds what no buffer records (kernels' code, library
// handles, graphs, the allocator's rounding) and not the pinned host memory.
func (m runMemory) text() string {
	s := m.layer.Text()
	if m.drop == nil {
		return s + "; MemInfo failed, so no fall of free device memory to compare"
	}
	return fmt.Sprintf("%s; free device memory fell by %s over load and forward (MemInfo)", s, bench.ByteSize(*m.drop))
}

// runMoeShards is moe run with --gpus above 1: the expert-parallel shards
// are built from the weights read on the host, then run by runMoeParallel.
func (a *app) runMoeShards(o moeRunOpts, in *moeRunInput, dt gpuctx.DType, start time.Time, ph *phases) error {
	ph.begin("load")
	w, err := loadLayerWeights(o.model, in.cfg, in.layer)
	if err != nil {
		return err
	}
	ph.begin("open")
	rt, _, err := a.openDevice()
	if err != nil {
		return err
	}
	defer rt.Close()
	ph.end()
	return a.runMoeParallel(o, moeParallelRun{rt: rt, cfg: in.cfg, w: w, layer: in.layer, x: in.x, T: in.T, name: in.name, reads: in.reads, dt: dt, start: start})
}

// weightMemoryText describes the device memory of l's weights, and for an
// FP8 layer what the same layer takes in bf16 (its routed experts, and the
// fused shared expert's chunks that both hold beside the shared expert, at
// two bytes a weight instead of one, without block scales).
func weightMemoryText(l *moe.Layer) string {
	n := l.DeviceWeightBytes()
	if !l.FP8() {
		return fmt.Sprintf("%s (%s)", bytesText(float64(n)), l.DType())
	}
	c := l.Config()
	H, I, E := int64(c.HiddenSize), int64(c.Intermediate), int64(c.NumExperts+l.FusedSharedChunks())
	bh, bi := (H+127)/128, (I+127)/128
	fp8Experts := E * (3*H*I + 3*4*bh*bi) // codes; gate, up and down scales
	bf16 := n - fp8Experts + E*3*H*I*2
	chunks := ""
	if l.FusedSharedChunks() > 0 {
		chunks = ", and the shared expert's fused chunks,"
	}
	return fmt.Sprintf("%s (routed experts in FP8%s with their block scales, the rest bf16; %.2fx the %s of the same layer in bf16)",
		bytesText(float64(n)), chunks, float64(n)/float64(bf16), bytesText(float64(bf16)))
}

// ms is d in milliseconds, to the microsecond.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }

// printMoeRun prints moe run's summary, or rep as JSON with --json.
func (a *app) printMoeRun(rep moeRunReport) error {
	if a.json {
		return a.jsonOut(rep)
	}
	fmt.Fprintf(a.out, "moe run: %s layer %d of %s on %s (%s)\n", rep.Family, rep.Layer, rep.Model, rep.Device, rep.Backend)
	fmt.Fprintf(a.out, "input %s[%d×%d] from %s, dtype %s, mode %s\n", rep.Tensor, rep.Tokens, rep.Hidden, rep.Input, rep.DType, rep.Mode)
	fmt.Fprintf(a.out, "load %.1f ms (weights to the device), forward %.3f ms (wall, host in/out); wrote y[%d×%d] F32 to %s\n",
		rep.LoadMS, rep.ForwardMS, rep.Tokens, rep.Hidden, rep.Output)
	return nil
}

// forwardMoe runs one forward of l on x, traced when --trace is set, and
// returns y and the forward's wall time (host in and out).
func (a *app) forwardMoe(cmd *cobra.Command, o moeRunOpts, in *moeRunInput, dev *gpuctx.Device, l *moe.Layer, mode moe.Mode, ph *phases) ([]float32, time.Duration, error) {
	tr, err := startTrace(dev, o.trace, in.reads, map[string]string{
		"command": invocation(cmd), "model": o.model, "model_type": string(in.cfg.Family), "layer": fmt.Sprint(in.layer),
		"tokens": fmt.Sprint(in.T), "dtype": l.DType().String(), "mode": mode.String(),
		"graphs": "off: the forward runs eagerly (moe.LayerOptions.NoGraphs), so every kernel is a span",
	})
	if err != nil {
		return nil, 0, err
	}
	endRange := func() {}
	if tr != nil {
		tr.tr.NameStream(l.MainStream(), "main stream (router, routed experts, combine)")
		tr.tr.NameStream(l.SideStream(), "side stream (shared expert in dual mode)")
		endRange = tr.tr.Range(l.MainStream(), fmt.Sprintf("moe forward T=%d %s", in.T, mode))
	}
	ph.begin("forward")
	t0 := time.Now()
	y, err := l.Forward(in.x, in.T)
	endRange()
	if err != nil {
		return nil, 0, fail("running the MoE layer", "check 'gpuctx info'; on a GPU, try --backend cpu to compare", err)
	}
	fwd := time.Since(t0)
	if tr != nil {
		ph.begin("trace")
	}
	if err := a.finishTrace(tr); err != nil {
		return nil, 0, err
	}
	if len(y) != in.T*in.cfg.HiddenSize {
		return nil, 0, fail(fmt.Sprintf("the layer returned %d values for T=%d, H=%d", len(y), in.T, in.cfg.HiddenSize), "please report this with the command line", nil)
	}
	return y, fwd, nil
}

// writeMoeOutput encodes y as the tensor y of a safetensors file, with the
// run in its metadata, and writes it to --output atomically.
func writeMoeOutput(o moeRunOpts, in *moeRunInput, backend string, dt gpuctx.DType, mode moe.Mode, y []float32) error {
	yt, err := safetensors.FromFloat32("y", safetensors.F32, []int{in.T, in.cfg.HiddenSize}, y)
	if err != nil {
		return fail("encoding the output", "", err)
	}
	meta := map[string]string{
		"producer": "gpuctx moe run", "model": o.model, "model_type": string(in.cfg.Family), "layer": fmt.Sprint(in.layer),
		"dtype": dt.String(), "mode": mode.String(), "backend": backend,
	}
	data, err := safetensors.Encode([]safetensors.Tensor{yt}, meta)
	if err != nil {
		return fail("encoding the output", "please report this with the command line", err)
	}
	// Check again: a path may have been linked to a model file meanwhile.
	if err := checkOutput("--output", o.output, in.reads); err != nil {
		return err
	}
	if err := writeOutput(o.output, data); err != nil {
		return fail(fmt.Sprintf("writing --output %s", o.output), "check that the directory is writable and has space", err)
	}
	return nil
}

// cpuFullSizeBytes is the layer size above which moe run on the CPU backend
// warns: the scaled-down shapes moe bench and moe init --small use there are
// a few MiB.
const cpuFullSizeBytes = 256 << 20

// warnFullSize prints a one-line warning on stderr when a layer of at least
// cpuFullSizeBytes runs on the CPU backend: there it checks results, and a
// large batch takes long (a DeepSeek-V2-Lite layer from moe init, f32, 256
// tokens: load 1.2 s, forward 8.9 s on the 2-core development machine).
func (a *app) warnFullSize(dev *gpuctx.Device, cfg *moe.Config, dt gpuctx.DType) {
	if dev.Backend() != "cpu" {
		return
	}
	H, E, I, S := int64(cfg.HiddenSize), int64(cfg.NumExperts), int64(cfg.Intermediate), int64(cfg.SharedIntermediate)
	b := (E*H + E*3*H*I + 3*H*S) * int64(dt.Size())
	if b < cpuFullSizeBytes {
		return
	}
	fmt.Fprintf(a.errOut, "gpuctx: warning: moe run: a full-size layer (%.1f GiB in %s, H=%d, E=%d) on the CPU backend: its times say nothing about a GPU and large batches take long; 'gpuctx moe init --small' writes a CPU-sized checkpoint\n",
		float64(b)/(1<<30), dt, cfg.HiddenSize, cfg.NumExperts)
}
