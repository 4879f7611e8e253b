package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/bench"
	"github.com/gpuctx/gpuctx/internal/atomicfile"
	"github.com/gpuctx/gpuctx/moe"
)

// Defaults of moe bench. The CPU backend shrinks them (see cpuBench*) so that
// the main job finishes in seconds on a machine without a GPU.
const (
	benchTokens    = "1,8,64,256,1024,4096,8192,16384"
	benchIters     = 50
	benchWarmup    = 5
	cpuBenchTokens = "1,8,64"
	cpuBenchIters  = 3
	cpuBenchWarmup = 1

	// The scaled-down preset shape used on the CPU backend.
	cpuHidden, cpuExperts, cpuIntermediate = bench.CPUHidden, bench.CPUExperts, bench.CPUIntermediate

	// Ceilings: a device-to-device copy of copyBytes and a bf16 gemmN³ GEMM.
	copyBytesCUDA, copyBytesCPU = 1 << 30, 64 << 20
	gemmNCUDA, gemmNCPU         = 8192, 512
)

type moeBenchOpts struct {
	preset, model string
	layer         int
	tokens, modes string
	trace         string
	dtype         string
	iters, warmup int
	seed          uint64
	plot, out     string
	fullSize      bool
	smallBatch    int
	noGraphs      bool
	noFused       bool
	tile          string
	peer, python  string // --peer script, --peer-python
	rounds, sets  int
	weights       string // --weights: uniform, normal or "" (by --peer)
	fp8WeightOnly bool
}

// The report types live in package bench.
type (
	moeBenchReport = bench.MoEReport
	benchRow       = bench.MoERow
	benchShape     = bench.MoEShape
	peerReport     = bench.PeerReport
)

// allowPeerOnCPU lets tests run a fake peer on the CPU backend; the real peer
// needs CUDA.
var allowPeerOnCPU = false

// moeBenchLong is moe bench's help text.
const moeBenchLong = `bench times one MoE layer on device 0 for each token count: seeded random
weights of a preset (default deepseek-v2-lite), or layer --layer of the
checkpoint in --model. For each token count it reports the median latency of
each --mode (single: everything on the main stream; dual: the shared expert on
a side stream), of the shared expert alone and of the router plus routed
experts alone, timed with device events around Layer.ForwardDevice on the
layer's main stream after warm-up.

The floor is max(bytes of the weights the batch touches / copy bandwidth,
FLOPs / GEMM rate), both ceilings measured in the same run: a large
device-to-device copy (bytes read + written) and a large GEMM in --dtype
through a Context (8192³ on CUDA, 512³ on the CPU backend). FLOPs = 2·T·H·E (router) + 2·T·K·3·H·I (routed) + 2·T·3·H·Is (shared).
"% of floor" is floor / best mode; "overlap" is (single - dual) /
min(shared alone, routed alone): 1 means the shared expert hid completely;
"fused overlap" is the same for the fused mode (the shared expert inside the
routed kernels), when it ran.

On the CPU backend the presets are scaled down (H=256, E=16, I=64; tokens
1,8,64; fewer iterations) so that the run takes seconds; --full-size keeps the
real shape. CPU times say nothing about a GPU, so there the table leaves out
the overlap and "% of floor" columns (--json keeps them).

Every forward rotates over --sets weight and input sets (one Layer each, on
one main stream), so that no forward finds its weights in L2, and the output
of every mode's last timed forward is checked against a single-stream forward
of the same input at every token count (a mismatch fails the run).

--peer bench/peers/triton_fused_moe.py runs the peer, vLLM's Triton fused MoE
rebuilt standalone (torch + triton, CUDA only; vLLM's tuned tile table where
vLLM ships one), in the same invocation: same preset, token counts,
iterations, warm-up and number of weight sets, and (by default with --peer)
the peer's weight distribution, N(0, 0.02²). --rounds N alternates gpuctx and
the peer N times (gpuctx first, then the peer first, ...); gpuctx's layers
stay on the device meanwhile. Its stderr and progress lines stream to stderr;
the table gains "peer µs" (the median over the rounds of its best mode:
eager, graph single, graph dual, graph tuned; named), the experts each side's
batches touched, and "vs peer" = peer best / gpuctx best of each round
(>1: gpuctx faster) as median (min-max); a last line gives the range over
token counts. If the peer fails, its later rounds are skipped, the table is
printed without it and the exit status is 1.

--peer bench/peers/triton_fused_moe_fp8.py is the same peer with the routed
experts in vLLM's fp8_w8a8 path (128x128 block scales, the weights quantized
as gpuctx quantizes them, activations per token per 128 columns): the peer of
--dtype fp8. The peer's env line says which precision it ran (the header's
peer line and the summary name it; a peer that names none ran bf16); when it
is not --dtype's, the run goes on and the report adds a note saying so (e.g.
"the peer runs bf16 weights while gpuctx runs fp8").

--dtype fp8 times the layer with its routed experts' weights in FP8 on the
device (moe.LayerOptions.FP8: E4M3 codes and 128x128 block scales, the w8a16
tiles, or on compute capability 9.0 the w8a8 tiles over activations quantized
to E4M3 on the device; timed per token bucket as the bf16 tiles, the w8a8
chains against the w8a16 tiles: the transposed pairs of BM = 8, 16, 32 rows
up to 2*BM rows per touched expert, the 64- and 128-row pairs from 8), the
rest bf16; its floor counts the FP8 bytes and scales the batch
touches (and the shared expert's bf16 bytes, in every mode). Mode fused (and
auto where it times fused faster than dual) runs the shared expert's FP8
chunks inside the FP8 tiles, so its output check against single allows 1e-1
instead of 2e-2. Run it beside --dtype bf16 to compare.

Progress goes to stderr: a bar on a terminal, else one line per step.`

func newMoeBenchCmd(a *app) *cobra.Command {
	o := moeBenchOpts{}
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Time one MoE layer per token count against the copy-bandwidth and GEMM floor",
		Long:  moeBenchLong,
		Example: `  gpuctx moe bench
  gpuctx moe bench --preset qwen1.5-moe --tokens 1,64,1024 --plot moe.png --out moe.md
  gpuctx moe bench --model ./DeepSeek-V2-Lite --layer 1 --mode single,dual,auto --json
  gpuctx moe bench --preset qwen1.5-moe --peer bench/peers/triton_fused_moe.py --rounds 3 --out moe.md
  gpuctx moe bench --preset deepseek-v3 --dtype fp8 --peer bench/peers/triton_fused_moe_fp8.py --out moe-fp8.md`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return a.runMoeBench(cmd, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.preset, "preset", "deepseek-v2-lite", "layer shape with random weights: "+strings.Join(moe.PresetNames(), ", "))
	f.StringVar(&o.model, "model", "", "checkpoint directory (config.json, model.safetensors) instead of a preset")
	f.IntVar(&o.layer, "layer", -1, "with --model: the decoder layer; -1: the first MoE layer")
	f.StringVar(&o.tokens, "tokens", benchTokens, "comma-separated token counts (on the CPU backend "+cpuBenchTokens+" unless set)")
	f.StringVar(&o.modes, "mode", "single,dual", "comma-separated modes to time: single, dual, auto, fused (the shared expert inside the fused kernels)")
	f.StringVar(&o.dtype, "dtype", "bf16", "layer compute type: bf16, f32, or fp8 (bf16 with the routed experts' weights in FP8 on the device; the floor counts their FP8 bytes and scales)")
	f.IntVar(&o.iters, "iters", benchIters, fmt.Sprintf("timed forwards per measurement; the median is reported (on the CPU backend %d unless set)", cpuBenchIters))
	f.IntVar(&o.warmup, "warmup", benchWarmup, fmt.Sprintf("untimed forwards first, at least two per weight set with --sets above 1 (on the CPU backend %d unless set)", cpuBenchWarmup))
	f.Uint64Var(&o.seed, "seed", 1, "seed of the random weights and inputs")
	f.StringVar(&o.plot, "plot", "", "write a log-log PNG of latency vs tokens to this file")
	f.StringVar(&o.out, "out", "", "write the markdown header and table to this file (for bench/RESULTS.md)")
	f.BoolVar(&o.fullSize, "full-size", false, "on the CPU backend, keep the preset's real shape (slow)")
	f.BoolVar(&o.noFused, "no-fused", false, "bf16: run the routed experts as grouped GEMMs with host-side sizes instead of the fused kernels")
	f.StringVar(&o.tile, "tile", "", "force one tile of the fused expert GEMMs instead of tuning per token bucket: an mma.sync tile (e.g. m16n64k64w1x4s6) or, on compute capability 9.0, a warpgroup tile (e.g. m128n128k64g2s4)")
	f.BoolVar(&o.noGraphs, "no-graphs", false, "run every forward eagerly (by default small batches replay a captured graph)")
	f.StringVar(&o.trace, "trace", "", traceHelp+"; after the timings, one eager forward per token count and mode is traced (implies --no-graphs)")
	f.StringVar(&o.peer, "peer", "", "time this peer script with the same preset, tokens and weight sets (e.g. "+bench.PeerDefaultScript+", or "+bench.PeerFP8Script+" with --dtype fp8; CUDA only)")
	f.IntVar(&o.rounds, "rounds", 1, "alternate gpuctx and the peer this many times (order swapped each round); without --peer, gpuctx's passes")
	f.IntVar(&o.sets, "sets", 0, "weight and input sets rotated between forwards (a Layer each); 0: the peer's number (3; 2 for deepseek-v3), 1 on the CPU backend")
	f.StringVar(&o.weights, "weights", "", "random weight distribution: uniform (U(±1/sqrt(fan_in)), bias U(±0.05)) or normal (N(0, 0.02²), the peer's); default normal with --peer, else uniform")
	f.StringVar(&o.python, "peer-python", "python3", "the Python interpreter that runs --peer")
	f.BoolVar(&o.fp8WeightOnly, "fp8-weight-only", false, fp8WeightOnlyHelp)
	f.IntVar(&o.smallBatch, "small-batch", 0, fmt.Sprintf("batches of at most this many tokens use the small-batch expert kernels (no host wait); 0: none for bf16 layers (the fused path is faster), %d for f32, -1: never", moe.DefaultSmallBatchTokens))
	return cmd
}

// parseTokens parses a comma-separated list of distinct positive token counts.
func parseTokens(s string) ([]int, error) {
	var out []int
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 1<<20 {
			return nil, fail(fmt.Sprintf("--tokens %q: %q is not a token count", s, p), "pass positive integers up to 1048576, comma-separated, e.g. 1,8,64", nil)
		}
		if slices.Contains(out, n) {
			return nil, fail(fmt.Sprintf("--tokens %q lists %d twice", s, n), "list each token count once", nil)
		}
		out = append(out, n)
	}
	return out, nil
}

// parseModes parses a comma-separated list of distinct modes.
func parseModes(s string) ([]moe.Mode, error) {
	var out []moe.Mode
	for _, p := range strings.Split(s, ",") {
		m, err := parseModeFlag(p)
		if err != nil {
			return nil, err
		}
		if slices.Contains(out, m) {
			return nil, fail(fmt.Sprintf("--mode %q lists %s twice", s, m), "list each mode once", nil)
		}
		out = append(out, m)
	}
	return out, nil
}

// scaleDown, layerElems and gib: see package bench (moe init uses them too).
func scaleDown(c *moe.Config) (*moe.Config, error) { return bench.ScaleDown(c) }
func layerElems(c *moe.Config) int64               { return bench.LayerElems(c) }
func gib(b float64) string                         { return bench.GiB(b) }

// batchFLOPs is the arithmetic of one forward of T tokens.
func batchFLOPs(c *moe.Config, T int) float64 { return bench.BatchFLOPs(c, T) }

// buildCommit, when set at link time (-ldflags "-X main.buildCommit=REV"),
// is the commit moe bench reports; binaries built with -buildvcs=false (the
// default GOFLAGS here) carry no VCS information otherwise.
var buildCommit string

// commit returns buildCommit, else the VCS revision the binary was built from,
// else the checkout's HEAD, else "unknown".
func commit() string {
	if buildCommit != "" {
		return buildCommit
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		rev, dirty := "", false
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if rev != "" {
			if dirty {
				rev += "-dirty"
			}
			return rev
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "git", "rev-parse", "HEAD").Output(); err == nil {
		rev := strings.TrimSpace(string(out))
		if st, err := exec.CommandContext(ctx, "git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
			rev += "-dirty"
		}
		return rev + " (checkout HEAD; not from build info)"
	}
	return "unknown (built with -buildvcs=false, outside a git checkout)"
}

// commandLine rebuilds the invocation from every flag the user set (the flag
// set's own record, so a new flag is never left out), in the order given, with
// $GPUCTX_BACKEND in front when it chose the backend.
func commandLine(cmd *cobra.Command) string {
	parts := []string{cmd.CommandPath()}
	fs := cmd.Flags()
	if v := os.Getenv(gpuctx.BackendEnv); v != "" && !fs.Changed("backend") {
		parts = append([]string{gpuctx.BackendEnv + "=" + shellQuote(v)}, parts...)
	}
	sorted := fs.SortFlags
	fs.SortFlags = false // Visit then walks the flags in the order they were set
	defer func() { fs.SortFlags = sorted }()
	fs.Visit(func(f *pflag.Flag) {
		switch {
		case f.Value.Type() == "bool" && f.Value.String() == "true":
			parts = append(parts, "--"+f.Name)
		case f.Value.Type() == "bool":
			parts = append(parts, "--"+f.Name+"=false")
		default:
			parts = append(parts, "--"+f.Name+" "+shellQuote(f.Value.String()))
		}
	})
	return strings.Join(parts, " ")
}

// shellQuote returns s as one shell word: unchanged when it needs no quoting,
// else in single quotes.
func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune(",._-+/:=@%^", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// moeBenchPlan is what runMoeBench resolved from the flags before opening
// the device.
type moeBenchPlan struct {
	cfg   *moe.Config // the preset's (nil with --model)
	dt    gpuctx.DType
	fp8   bool // --dtype fp8: dt is bf16, the routed experts FP8
	modes []moe.Mode
	dist  moe.InitDist
	peer  *bench.PeerSpec // nil: no --peer
}

func (a *app) runMoeBench(cmd *cobra.Command, o moeBenchOpts) error {
	p, err := a.planMoeBench(cmd, &o)
	if err != nil {
		return err
	}
	rep, peerErr, err := a.measureMoeBench(cmd, o, p)
	if err != nil {
		return err
	}
	return a.writeMoeBench(o, rep, peerErr)
}

// checkMoeBenchFlags refuses flags that contradict each other or are out of
// range.
func checkMoeBenchFlags(changed func(string) bool, o *moeBenchOpts) error {
	switch {
	case changed("preset") && changed("model"):
		return fail("--preset and --model are both set", "pass one: a preset (random weights) or a checkpoint directory", nil)
	case changed("layer") && o.model == "":
		return fail("--layer needs --model", "pass --model DIR, or drop --layer (presets have one layer)", nil)
	case o.iters < 1 || o.warmup < 0:
		return fail(fmt.Sprintf("--iters %d / --warmup %d", o.iters, o.warmup), "pass --iters >= 1 and --warmup >= 0", nil)
	case o.rounds < 1 || o.rounds > 100:
		return fail(fmt.Sprintf("--rounds %d", o.rounds), "pass --rounds from 1 to 100", nil)
	case o.sets < 0 || o.sets > 16:
		return fail(fmt.Sprintf("--sets %d", o.sets), "pass --sets from 1 to 16, or 0 for the peer's number", nil)
	case o.weights != "" && o.model != "":
		return fail("--weights with --model", "the checkpoint has its own weights: drop --weights", nil)
	case changed("peer-python") && o.peer == "":
		return fail("--peer-python without --peer", "pass --peer "+bench.PeerDefaultScript+", or drop --peer-python", nil)
	}
	if changed("tokens") {
		if _, err := parseTokens(o.tokens); err != nil {
			return err
		}
	}
	return nil
}

// fp8FusedCheckTol is moe bench's output check tolerance for --dtype fp8:
// where the tuner picks them (at any batch size: the transposed pairs are
// timed from one row per touched expert) single and dual run the w8a8 tiles
// (activations in E4M3: 2.5-5.6% from the w8a16 result on random layers,
// moe's TestLayerFP8W8A8), while fused (and auto, which runs it up to 16
// tokens) keeps the w8a16 tiles for the shared expert's chunks, and a chunk
// whose cut is not on a 128 block edge is quantized twice (fused mode at
// 4.5% from single on the H200, bench/RESULTS.md 2026-12-02, before the
// dense shared expert took the FP8 values too).
const fp8FusedCheckTol = 1e-1

// benchCheckTol is the output check tolerance of a layer of dt (fp8: FP8
// routed experts): bench.CheckTol, or fp8FusedCheckTol.
func benchCheckTol(dt gpuctx.DType, fp8 bool) float64 {
	if fp8 {
		return fp8FusedCheckTol
	}
	return bench.CheckTol(dt)
}

// checkFP8BenchFlags refuses the flags an FP8 layer cannot honour.
func checkFP8BenchFlags(o *moeBenchOpts) error {
	switch {
	case o.tile != "":
		return fail("--dtype fp8 with --tile", "--tile names a bf16 tile; the FP8 layer picks its own tiles: drop --tile", nil)
	case o.noFused:
		return fail("--dtype fp8 with --no-fused", "the FP8 experts run on the fused path only: drop --no-fused", nil)
	case o.smallBatch > 0:
		return fail(fmt.Sprintf("--dtype fp8 with --small-batch %d", o.smallBatch), "the FP8 experts have no small-batch kernels: drop --small-batch", nil)
	}
	return nil
}

// planMoeBench checks the flags and resolves what they name.
func (a *app) planMoeBench(cmd *cobra.Command, o *moeBenchOpts) (*moeBenchPlan, error) {
	if err := checkMoeBenchFlags(cmd.Flags().Changed, o); err != nil {
		return nil, err
	}
	p := &moeBenchPlan{}
	var err error
	if p.dt, err = parseLayerDType(o.dtype); err != nil {
		return nil, err
	}
	if p.modes, err = parseModes(o.modes); err != nil {
		return nil, err
	}
	if p.fp8 = isFP8(o.dtype); p.fp8 {
		if err := checkFP8BenchFlags(o); err != nil {
			return nil, err
		}
	} else if o.fp8WeightOnly {
		return nil, fail("--fp8-weight-only without --dtype fp8", "it picks the FP8 experts' tiles: add --dtype fp8, or drop it", nil)
	}
	if o.model == "" {
		if p.cfg, err = moe.Preset(o.preset); err != nil {
			return nil, fail(fmt.Sprintf("--preset %q is not a preset", o.preset), "use one of "+strings.Join(moe.PresetNames(), ", "), nil)
		}
	}
	if p.peer, err = a.planPeer(o); err != nil {
		return nil, err
	}
	dist := o.weights
	if dist == "" {
		dist = map[bool]string{false: "uniform", true: "normal"}[p.peer != nil]
	}
	if p.dist, err = moe.ParseInitDist(dist); err != nil {
		return nil, fail(fmt.Sprintf("--weights %q is not a distribution", o.weights), "use uniform or normal", nil)
	}
	if o.trace != "" {
		if err := a.checkTraceTarget(o); err != nil {
			return nil, err
		}
		o.noGraphs = true // a graph replay is one span: run eagerly so that every kernel shows
	}
	return p, nil
}

// checkTraceTarget refuses a --trace path that names one of the run's inputs.
func (a *app) checkTraceTarget(o *moeBenchOpts) error {
	var reads []readFile
	if o.model != "" {
		var err error
		if reads, err = modelFiles(o.model); err != nil {
			return err
		}
	}
	return checkOutput("--trace", o.trace, reads)
}

// planPeer resolves --peer (nil without it).
func (a *app) planPeer(o *moeBenchOpts) (*bench.PeerSpec, error) {
	if o.peer == "" {
		return nil, nil
	}
	if o.model != "" {
		return nil, fail("--peer with --model", "the peer runs presets only (random weights of a known shape): pass --preset, or drop --peer", nil)
	}
	preset, ok := bench.PeerPresets[o.preset]
	if !ok {
		return nil, fail(fmt.Sprintf("--peer: the peer has no preset for %s", o.preset), "use one of "+strings.Join(slices.Sorted(maps.Keys(bench.PeerPresets)), ", "), nil)
	}
	if st, err := os.Stat(o.peer); err != nil || st.IsDir() {
		return nil, fail(fmt.Sprintf("--peer %s: no such script", o.peer), "pass the peer's path, e.g. --peer "+bench.PeerDefaultScript+" from the repository root", err)
	}
	return &bench.PeerSpec{Script: o.peer, Python: o.python, Preset: preset, ErrOut: a.errOut}, nil
}

// newMoeReport returns the report's header for a run on dev, after applying
// the CPU backend's defaults to o (token counts, iterations, weight sets).
func newMoeReport(cmd *cobra.Command, o *moeBenchOpts, dev *gpuctx.Device, p *moeBenchPlan) *moeBenchReport {
	changed := cmd.Flags().Changed
	cpu := dev.Backend() == "cpu"
	if cpu {
		for _, d := range []struct {
			flag string
			set  func()
		}{{"tokens", func() { o.tokens = cpuBenchTokens }}, {"iters", func() { o.iters = cpuBenchIters }}, {"warmup", func() { o.warmup = cpuBenchWarmup }}} {
			if !changed(d.flag) {
				d.set()
			}
		}
	}
	if o.sets == 0 {
		o.sets = bench.PeerSets(o.preset)
		if cpu {
			o.sets = 1
		}
	}
	rep := &moeBenchReport{Backend: dev.Backend(), Device: dev.Info().Name, DType: layerDTypeName(p.dt, p.fp8),
		Date: time.Now().UTC().Format("2006-01-02 15:04 UTC"), Commit: commit(), Command: commandLine(cmd),
		Seed: o.seed, Iters: o.iters, Warmup: o.warmup, Sets: o.sets, Rounds: o.rounds, Notes: []string{}}
	if o.fp8WeightOnly {
		rep.Notes = append(rep.Notes, "--fp8-weight-only: the routed experts ran the w8a16 tiles only (bf16 activations, never quantized to FP8)")
	}
	for _, m := range p.modes {
		rep.Modes = append(rep.Modes, m.String())
	}
	if p.peer != nil {
		p.peer.Sets = o.sets
		rep.Peer = &peerReport{Name: bench.PeerName, Script: o.peer, Python: o.python, Preset: p.peer.Preset}
	}
	return rep
}

// benchWeights returns the layer's config and the weights of each set: the
// checkpoint's layer (the same weights in every set's buffers), or random
// weights of the preset (set s drawn with seed+s), scaled down on the CPU
// backend unless --full-size; it warns on stderr when a full-size layer runs
// on the CPU backend.
func (a *app) benchWeights(dev *gpuctx.Device, o *moeBenchOpts, p *moeBenchPlan, rep *moeBenchReport) (*moe.Config, func(int) (*moe.Weights, error), error) {
	cpu := dev.Backend() == "cpu"
	if o.model != "" {
		cfg, layer, err := resolveModel(o.model, o.layer)
		if err != nil {
			return nil, nil, err
		}
		w, err := loadLayerWeights(o.model, cfg, layer)
		if err != nil {
			return nil, nil, err
		}
		rep.Model, rep.Layer = o.model, &layer
		if cpu && largerThanCPUShape(cfg) {
			fmt.Fprintf(a.errOut, "moe bench: warning: the checkpoint's layer runs at its full size (H=%d, E=%d, I=%d) on the CPU backend: expect minutes per token count\n", cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate)
		}
		return cfg, func(int) (*moe.Weights, error) { return w, nil }, nil
	}
	cfg := p.cfg
	rep.Preset, rep.WeightDist = o.preset, p.dist.String()
	if cpu && !o.fullSize {
		full := *cfg
		var err error
		if cfg, err = scaleDown(cfg); err != nil {
			return nil, nil, err
		}
		rep.ScaledDown = true
		rep.Notes = append(rep.Notes, fmt.Sprintf("CPU backend: preset %s scaled down from H=%d, E=%d, I=%d, shared=%d to H=%d, E=%d, I=%d, shared=%d (top-%d) so that the run takes seconds; --full-size keeps the real shape. CPU times say nothing about a GPU.",
			o.preset, full.HiddenSize, full.NumExperts, full.Intermediate, full.SharedIntermediate,
			cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate, cfg.SharedIntermediate, cfg.TopK))
	}
	note, err := bench.CheckMemory(dev, cfg, p.dt, o.preset, o.sets)
	if err != nil {
		return nil, nil, err
	}
	if cpu && o.fullSize && largerThanCPUShape(cfg) {
		fmt.Fprintf(a.errOut, "moe bench: warning: preset %s runs at its full size on the CPU backend (--full-size): expect minutes per token count\n", o.preset)
	}
	if note != "" {
		rep.Notes = append(rep.Notes, note)
	}
	return cfg, func(s int) (*moe.Weights, error) {
		w, err := moe.RandomWeightsDist(cfg, o.seed+uint64(s), p.dist)
		if err != nil {
			return nil, fail("generating random weights", "", err)
		}
		return w, nil
	}, nil
}

// largerThanCPUShape reports whether cfg has more weights than the shape the
// CPU backend scales presets down to (such a layer takes minutes there).
func largerThanCPUShape(cfg *moe.Config) bool {
	small, err := scaleDown(cfg)
	return err != nil || layerElems(cfg) > layerElems(small)
}

// benchTracer records moe bench's traced forwards into a --trace run.
type benchTracer struct{ tr *traceRun }

func (t benchTracer) Streams(main, side *gpuctx.Stream) {
	t.tr.tr.NameStream(main, "main stream (router, routed experts, combine)")
	t.tr.tr.NameStream(side, "side stream (shared expert in dual mode)")
}

func (t benchTracer) Forward(name string, main *gpuctx.Stream, run func() error) error {
	t.tr.resume()
	end := t.tr.tr.Range(main, name)
	err := run()
	end()
	t.tr.pause()
	if err == nil {
		err = main.Synchronize()
	}
	return err
}

// startBenchTrace starts the --trace recording, paused (nil without --trace).
func startBenchTrace(cmd *cobra.Command, dev *gpuctx.Device, o moeBenchOpts, rep *moeBenchReport) (*traceRun, error) {
	var reads []readFile
	if o.model != "" {
		var err error
		if reads, err = modelFiles(o.model); err != nil {
			return nil, err
		}
	}
	tr, err := startTrace(dev, o.trace, reads, map[string]string{
		"command": commandLine(cmd), "preset": rep.Preset, "model": rep.Model, "dtype": rep.DType,
		"graphs": "off: --trace runs the layer eagerly (moe.LayerOptions.NoGraphs), for the timings too, so that every kernel is a span",
		"traced": "after each token count's timings (first round), one forward per mode on weight set 0 (the timed runs are not traced)",
	})
	if err != nil || tr == nil {
		return nil, err
	}
	tr.pause()
	rep.Notes = append(rep.Notes, "--trace: every forward ran eagerly (no graphs)")
	return tr, nil
}

// benchOptions returns the options of the bench of o on dev.
func (a *app) benchOptions(dev *gpuctx.Device, o *moeBenchOpts, p *moeBenchPlan, rep *moeBenchReport) (bench.MoEOptions, error) {
	tokens, err := parseTokens(o.tokens)
	if err != nil {
		return bench.MoEOptions{}, err
	}
	cfg, weights, err := a.benchWeights(dev, o, p, rep)
	if err != nil {
		return bench.MoEOptions{}, err
	}
	rep.Shape = benchShape{Family: string(cfg.Family), Hidden: cfg.HiddenSize, Experts: cfg.NumExperts, TopK: cfg.TopK,
		Intermediate: cfg.Intermediate, Shared: cfg.SharedIntermediate}
	bo := bench.MoEOptions{Config: cfg, Weights: weights, Modes: p.modes, Tokens: tokens, Iters: o.iters, Warmup: o.warmup,
		Sets: o.sets, Seed: o.seed, CopyBytes: copyBytesCUDA, GemmN: gemmNCUDA, GemmPerRound: 5, CheckTol: benchCheckTol(p.dt, p.fp8),
		Layer: moe.LayerOptions{DType: p.dt, Mode: p.modes[0], AutoThreshold: moe.DefaultAutoThreshold, SmallBatchTokens: o.smallBatch,
			NoGraphs: o.noGraphs, NoFused: o.noFused, Tile: o.tile, Tokens: tokens, FP8: p.fp8, FP8WeightOnly: o.fp8WeightOnly}}
	if dev.Backend() == "cpu" {
		bo.CopyBytes, bo.GemmN, bo.GemmPerRound = copyBytesCPU, gemmNCPU, 1
	}
	rep.CopyBytes, rep.GemmN = bo.CopyBytes, bo.GemmN
	if p.peer != nil {
		rep.Peer.Command = p.peer.Command(tokens, o.iters, o.warmup)
	}
	return bo, nil
}

// measureMoeBench opens the device, builds the layers, measures the ceilings
// and runs the rounds, and closes the device again. peerErr is the peer's
// failure (gpuctx's results are complete); err is gpuctx's.
func (a *app) measureMoeBench(cmd *cobra.Command, o moeBenchOpts, p *moeBenchPlan) (_ *moeBenchReport, peerErr, err error) {
	rt, dev, err := a.openDevice()
	if err != nil {
		return nil, nil, err
	}
	defer rt.Close()
	if p.peer != nil && dev.Backend() == "cpu" && !allowPeerOnCPU {
		return nil, nil, fail("--peer on the CPU backend", "the peer ("+bench.PeerName+") needs CUDA: run on a GPU machine, or drop --peer", nil)
	}
	rep := newMoeReport(cmd, &o, dev, p)
	bo, err := a.benchOptions(dev, &o, p, rep)
	if err != nil {
		return nil, nil, err
	}
	tr, err := startBenchTrace(cmd, dev, o, rep)
	if err != nil {
		return nil, nil, err
	}
	if tr != nil {
		bo.Tracer = benchTracer{tr}
	}
	pr := a.newStepProgress("moe bench")
	bo.Progress = pr
	pr.Begin(bench.MoESteps(bo, o.rounds, p.peer != nil), "ceilings")
	b, err := bench.NewMoEBench(dev, bo)
	if err != nil {
		pr.End()
		tr.pause()
		return nil, nil, err
	}
	defer b.Close()
	peerErr, err = b.RunRounds(cmd.Context(), p.peer, o.rounds, rep)
	pr.End()
	if err != nil {
		tr.pause()
		return nil, nil, err
	}
	rep.CopyBW, rep.GemmRate = b.CopyBW, b.GemmRate
	if err := a.finishTrace(tr); err != nil {
		return nil, nil, err
	}
	for _, line := range b.TileChoices() {
		rep.Notes = append(rep.Notes, "fused tiles (weight set 0): "+line)
	}
	if peerErr != nil {
		rep.Peer.Error = oneLine(peerErr.Error())
		peerErr = fail(fmt.Sprintf("the peer (%s) failed", o.peer), "gpuctx's own results are above; the peer needs CUDA, torch and triton ("+o.python+")", peerErr)
	}
	if rep.Peer != nil {
		rep.Peer.OK = peerErr == nil
	}
	return rep, peerErr, nil
}

// writeMoeBench writes --out, --plot and the table (or --json), and returns
// peerErr.
func (a *app) writeMoeBench(o moeBenchOpts, rep *moeBenchReport, peerErr error) error {
	md := markdown(rep)
	if o.out != "" {
		if err := atomicfile.WriteFile(o.out, []byte(md)); err != nil {
			return fail(fmt.Sprintf("writing --out %s", o.out), "check that the directory exists and is writable", err)
		}
	}
	if o.plot != "" {
		if err := writePlot(rep, o.plot); err != nil {
			return fail(fmt.Sprintf("writing --plot %s", o.plot), "check that the directory exists and is writable", err)
		}
	}
	if a.json {
		if err := a.jsonOut(rep); err != nil {
			return err
		}
		if rep.Peer != nil {
			fmt.Fprintln(a.errOut, rep.PeerSummary())
		}
		return peerErr
	}
	if _, err := io.WriteString(a.out, md); err != nil {
		return err
	}
	return peerErr
}
