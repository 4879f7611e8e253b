package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/internal/atomicfile"
	"github.com/gpuctx/gpuctx/bench"
	"github.com/gpuctx/gpuctx/internal/sysmem"
	"github.com/gpuctx/gpuctx/moe"
)

// Defaults of moe bench. The CPU backend shrinks them (see cpuBench*) so that
// the main job finishes in seconds on a machine without a GPU.
const (
	benchTokens    = "1,8,64,256,1024,4096"
	benchIters     = 50
	benchWarmup    = 5
	cpuBenchTokens = "1,8,64"
	cpuBenchIters  = 3
	cpuBenchWarmup = 1

	// The scaled-down preset shape used on the CPU backend.
	cpuHidden, cpuExperts, cpuIntermediate = 256, 16, 64

	// Ceilings: a device-to-device copy of copyBytes and a bf16 gemmN³ GEMM.
	copyBytesCUDA, copyBytesCPU = 1 << 30, 64 << 20
	gemmNCUDA, gemmNCPU         = 8192, 512

	// fullSizeCPULimit bounds the host memory a full-size preset may take on the
	// CPU backend (f32 host weights plus the simulated device copy).
	fullSizeCPULimit = 16 << 30
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
}

// benchShape is the layer shape a bench ran.
type benchShape struct {
	Family       string `json:"model_type"`
	Hidden       int    `json:"hidden_size"`
	Experts      int    `json:"experts"`
	TopK         int    `json:"top_k"`
	Intermediate int    `json:"intermediate"`
	Shared       int    `json:"shared_intermediate"`
}

// benchRow is one token count's results. Latencies are medians in microseconds;
// nil means not measured (no shared expert).
type benchRow struct {
	Tokens         int                `json:"tokens"`
	MedianUS       map[string]float64 `json:"median_us"` // per mode: single, dual, auto
	SharedUS       *float64           `json:"shared_alone_us"`
	RoutedUS       float64            `json:"routed_alone_us"`
	Overlap        *float64           `json:"overlap_efficiency"`       // (single-dual)/min(shared,routed)
	FusedOverlap   *float64           `json:"fused_overlap_efficiency"` // (single-fused)/min(shared,routed)
	WeightBytes    int64              `json:"weight_bytes"`
	FLOPs          float64            `json:"flops"`
	BytesFloorUS   float64            `json:"bytes_floor_us"`
	ComputeFloorUS float64            `json:"compute_floor_us"`
	FloorUS        float64            `json:"floor_us"`
	Bound          string             `json:"bound"` // "bytes" or "compute"
	Best           string             `json:"best_mode"`
	PctOfFloor     float64            `json:"pct_of_floor"` // 100*floor/best

	// With --peer: the peer's median per mode, its best mode, and
	// peer best / gpuctx best (>1: gpuctx faster). Absent without a peer
	// result for this token count.
	PeerUS        map[string]float64 `json:"peer_us,omitempty"`
	PeerBestUS    *float64           `json:"peer_best_us,omitempty"`
	PeerBestMode  string             `json:"peer_best_mode,omitempty"`
	SpeedupVsPeer *float64           `json:"speedup_vs_peer,omitempty"`
}

// moeBenchReport is what moe bench prints with --json.
type moeBenchReport struct {
	Backend    string      `json:"backend"`
	Device     string      `json:"device"`
	DType      string      `json:"dtype"`
	Date       string      `json:"date"`
	Commit     string      `json:"commit"`
	Command    string      `json:"command"`
	Preset     string      `json:"preset,omitempty"`
	Model      string      `json:"model,omitempty"`
	Layer      *int        `json:"layer,omitempty"`
	ScaledDown bool        `json:"scaled_down"`
	Seed       uint64      `json:"seed"`
	Shape      benchShape  `json:"shape"`
	Modes      []string    `json:"modes"`
	Iters      int         `json:"iters"`
	Warmup     int         `json:"warmup"`
	CopyBytes  int         `json:"copy_bytes"`
	CopyBW     float64     `json:"copy_bytes_per_s"` // read + written
	GemmN      int         `json:"gemm_n"`
	GemmRate   float64     `json:"gemm_flop_per_s"`
	Notes      []string    `json:"notes"`
	Rows       []benchRow  `json:"rows"`
	Peer       *peerReport `json:"peer,omitempty"` // with --peer
}

func newMoeBenchCmd(a *app) *cobra.Command {
	o := moeBenchOpts{}
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Time one MoE layer per token count against the copy-bandwidth and GEMM floor",
		Long: `bench times one MoE layer on device 0 for each token count: seeded random
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

--peer bench/peers/triton_fused_moe.py runs the peer, vLLM's Triton fused MoE
rebuilt standalone (torch + triton, CUDA only), after gpuctx's measurements in
the same invocation: same preset, token counts, iterations and warm-up. Its
stderr and progress lines stream to stderr; the table gains "peer µs" (the best
of its modes: eager, graph single, graph dual, graph tuned; named) and
"vs peer" = peer best / gpuctx best (>1: gpuctx faster), and a last line gives
the range over token counts. If the peer fails, the table is printed without
it and the exit status is 1.`,
		Example: `  gpuctx moe bench
  gpuctx moe bench --preset qwen1.5-moe --tokens 1,64,1024 --plot moe.png --out moe.md
  gpuctx moe bench --model ./DeepSeek-V2-Lite --layer 1 --mode single,dual,auto --json
  gpuctx moe bench --preset qwen1.5-moe --peer bench/peers/triton_fused_moe.py --out moe.md`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return a.runMoeBench(cmd, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.preset, "preset", "deepseek-v2-lite", "layer shape with random weights: "+strings.Join(moe.PresetNames(), ", "))
	f.StringVar(&o.model, "model", "", "checkpoint directory (config.json, model.safetensors) instead of a preset")
	f.IntVar(&o.layer, "layer", -1, "with --model: the decoder layer; -1: the first MoE layer")
	f.StringVar(&o.tokens, "tokens", benchTokens, "comma-separated token counts (on the CPU backend "+cpuBenchTokens+" unless set)")
	f.StringVar(&o.modes, "mode", "single,dual", "comma-separated modes to time: single, dual, auto, fused (the shared expert inside the fused kernels)")
	f.StringVar(&o.dtype, "dtype", "bf16", "layer compute type: bf16 or f32")
	f.IntVar(&o.iters, "iters", benchIters, fmt.Sprintf("timed forwards per measurement; the median is reported (on the CPU backend %d unless set)", cpuBenchIters))
	f.IntVar(&o.warmup, "warmup", benchWarmup, fmt.Sprintf("untimed forwards first (on the CPU backend %d unless set)", cpuBenchWarmup))
	f.Uint64Var(&o.seed, "seed", 1, "seed of the random weights and inputs")
	f.StringVar(&o.plot, "plot", "", "write a log-log PNG of latency vs tokens to this file")
	f.StringVar(&o.out, "out", "", "write the markdown header and table to this file (for bench/RESULTS.md)")
	f.BoolVar(&o.fullSize, "full-size", false, "on the CPU backend, keep the preset's real shape (slow)")
	f.BoolVar(&o.noFused, "no-fused", false, "bf16: run the routed experts as grouped GEMMs with host-side sizes instead of the fused kernels")
	f.StringVar(&o.tile, "tile", "", "force one tile of the fused expert GEMMs instead of tuning per token bucket: an mma.sync tile (e.g. m16n64k64w1x4s6) or, on compute capability 9.0, a warpgroup tile (e.g. m128n128k64g2s4)")
	f.BoolVar(&o.noGraphs, "no-graphs", false, "run every forward eagerly (by default small batches replay a captured graph)")
	f.StringVar(&o.trace, "trace", "", traceHelp+"; after the timings, one eager forward per token count and mode is traced (implies --no-graphs)")
	f.StringVar(&o.peer, "peer", "", "after gpuctx's runs, time this peer script with the same preset and tokens (e.g. "+peerDefaultScript+"; CUDA only)")
	f.StringVar(&o.python, "peer-python", "python3", "the Python interpreter that runs --peer")
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

// scaleDown returns a copy of c with the CPU backend's small shape, keeping its
// routing rules and the ratio of its shared expert's width to a routed one's.
func scaleDown(c *moe.Config) (*moe.Config, error) {
	s := *c
	ratio := 0
	if c.SharedIntermediate > 0 {
		ratio = max(1, int(math.Round(float64(c.SharedIntermediate)/float64(c.Intermediate))))
	}
	s.HiddenSize, s.NumExperts, s.Intermediate = cpuHidden, cpuExperts, cpuIntermediate
	s.SharedIntermediate = ratio * cpuIntermediate
	s.TopK = min(c.TopK, s.NumExperts)
	if s.NumGroups > 1 && s.NumExperts%s.NumGroups != 0 {
		s.NumGroups, s.TopKGroups = 1, 1
	}
	if err := s.Validate(); err != nil {
		return nil, fail("scaling the preset down for the CPU backend", "pass --full-size, or report this", err)
	}
	return &s, nil
}

// layerBytes returns the element count of a layer's weights.
func layerElems(c *moe.Config) int64 {
	H, E, I, S := int64(c.HiddenSize), int64(c.NumExperts), int64(c.Intermediate), int64(c.SharedIntermediate)
	n := E*H + E*3*H*I + 3*H*S
	if c.SharedGate {
		n += H
	}
	return n
}

func gib(b float64) string { return fmt.Sprintf("%.1f GiB", b/(1<<30)) }

// checkMemory refuses a preset whose random weights cannot fit, and returns a
// note about large ones.
func checkMemory(dev *gpuctx.Device, c *moe.Config, dt gpuctx.DType, name string) (string, error) {
	elems := float64(layerElems(c))
	host, device := 4*elems, float64(dt.Size())*elems
	fix := "use --model DIR (weights read from disk) or a smaller preset"
	if dev.Backend() == "cpu" && host+device > fullSizeCPULimit {
		return "", fail(fmt.Sprintf("preset %s at full size needs ~%s of host memory for its f32 random weights plus ~%s of simulated device memory on the CPU backend",
			name, gib(host), gib(device)), "drop --full-size (the CPU backend then runs a scaled-down shape) or run on a GPU", nil)
	}
	if avail := sysmem.Field("MemAvailable"); avail > 0 && host > 0.9*float64(avail) {
		return "", fail(fmt.Sprintf("preset %s needs ~%s of host memory for its f32 random weights; %s is available", name, gib(host), gib(float64(avail))), fix, nil)
	}
	if free, _, err := dev.MemInfo(); err == nil && dev.Backend() != "cpu" && device > 0.9*float64(free) {
		return "", fail(fmt.Sprintf("preset %s needs ~%s of device memory in %s; %s is free", name, gib(device), dt, gib(float64(free))), fix, nil)
	}
	if host > 4<<30 {
		return fmt.Sprintf("random weights take ~%s of host memory (f32) and ~%s of device memory (%s)", gib(host), gib(device), dt), nil
	}
	return "", nil
}

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

// stderrIsTerminal reports whether w is a character device (a terminal).
func stderrIsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// batchFLOPs is the arithmetic of one forward of T tokens.
func batchFLOPs(c *moe.Config, T int) float64 { return bench.BatchFLOPs(c, T) }

func (a *app) runMoeBench(cmd *cobra.Command, o moeBenchOpts) error {
	changed := cmd.Flags().Changed
	if changed("preset") && changed("model") {
		return fail("--preset and --model are both set", "pass one: a preset (random weights) or a checkpoint directory", nil)
	}
	if changed("layer") && o.model == "" {
		return fail("--layer needs --model", "pass --model DIR, or drop --layer (presets have one layer)", nil)
	}
	dt, err := parseLayerDType(o.dtype)
	if err != nil {
		return err
	}
	modes, err := parseModes(o.modes)
	if err != nil {
		return err
	}
	if changed("tokens") {
		if _, err := parseTokens(o.tokens); err != nil {
			return err
		}
	}
	if o.iters < 1 || o.warmup < 0 {
		return fail(fmt.Sprintf("--iters %d / --warmup %d", o.iters, o.warmup), "pass --iters >= 1 and --warmup >= 0", nil)
	}
	var cfg *moe.Config
	if o.model == "" {
		if cfg, err = moe.Preset(o.preset); err != nil {
			return fail(fmt.Sprintf("--preset %q is not a preset", o.preset), "use one of "+strings.Join(moe.PresetNames(), ", "), nil)
		}
	}
	var peerPreset string
	if o.peer != "" {
		if o.model != "" {
			return fail("--peer with --model", "the peer runs presets only (random weights of a known shape): pass --preset, or drop --peer", nil)
		}
		var ok bool
		if peerPreset, ok = peerPresets[o.preset]; !ok {
			return fail(fmt.Sprintf("--peer: the peer has no preset for %s", o.preset), "use one of "+strings.Join(slices.Sorted(maps.Keys(peerPresets)), ", "), nil)
		}
		if st, err := os.Stat(o.peer); err != nil || st.IsDir() {
			return fail(fmt.Sprintf("--peer %s: no such script", o.peer), "pass the peer's path, e.g. --peer "+peerDefaultScript+" from the repository root", err)
		}
	} else if changed("peer-python") {
		return fail("--peer-python without --peer", "pass --peer "+peerDefaultScript+", or drop --peer-python", nil)
	}
	if o.trace != "" {
		var reads []readFile
		if o.model != "" {
			if reads, err = modelFiles(o.model); err != nil {
				return err
			}
		}
		if err := checkOutput("--trace", o.trace, reads); err != nil {
			return err
		}
		// A graph replay is one span: run eagerly so that every kernel shows.
		o.noGraphs = true
	}
	rep, err := a.measureMoeBench(cmd, o, cfg, dt, modes)
	if err != nil {
		return err
	}

	// The peer runs after gpuctx has released the device.
	var peerErr error
	if o.peer != "" {
		args := peerArgs(o.peer, peerPreset, rep.tokens(), rep.Iters, rep.Warmup)
		rep.Peer = &peerReport{Name: peerName, Script: o.peer, Python: o.python, Preset: peerPreset,
			Command: o.python + " " + strings.Join(args, " ")}
		fmt.Fprintf(a.errOut, "moe bench: running the peer: %s\n", rep.Peer.Command)
		debug.FreeOSMemory() // the host copy of the weights is garbage now
		rows, err := runPeer(cmd.Context(), o.python, args, rep.tokens(), a.errOut)
		rep.applyPeer(rows)
		rep.Peer.OK = err == nil
		if err != nil {
			rep.Peer.Error = oneLine(err.Error())
			peerErr = fail(fmt.Sprintf("the peer (%s) failed", o.peer), "gpuctx's own results are above; the peer needs CUDA, torch and triton ("+o.python+")", err)
		}
	}

	md := rep.markdown()
	if o.out != "" {
		if err := atomicfile.WriteFile(o.out, []byte(md)); err != nil {
			return fail(fmt.Sprintf("writing --out %s", o.out), "check that the directory exists and is writable", err)
		}
	}
	if o.plot != "" {
		if err := rep.writePlot(o.plot); err != nil {
			return fail(fmt.Sprintf("writing --plot %s", o.plot), "check that the directory exists and is writable", err)
		}
	}
	if a.json {
		if err := a.jsonOut(rep); err != nil {
			return err
		}
		if rep.Peer != nil {
			fmt.Fprintln(a.errOut, rep.peerSummary())
		}
		return peerErr
	}
	if _, err = io.WriteString(a.out, md); err != nil {
		return err
	}
	return peerErr
}

// tokens returns the token counts of the rows.
func (r *moeBenchReport) tokens() []int {
	ts := make([]int, len(r.Rows))
	for i, row := range r.Rows {
		ts[i] = row.Tokens
	}
	return ts
}

// measureMoeBench opens the device, measures the ceilings and every token
// count, and closes the device again.
func (a *app) measureMoeBench(cmd *cobra.Command, o moeBenchOpts, cfg *moe.Config, dt gpuctx.DType, modes []moe.Mode) (*moeBenchReport, error) {
	changed := cmd.Flags().Changed
	rt, dev, err := a.openDevice()
	if err != nil {
		return nil, err
	}
	defer rt.Close()
	cpu := dev.Backend() == "cpu"
	if o.peer != "" && cpu && !allowPeerOnCPU {
		return nil, fail("--peer on the CPU backend", "the peer ("+peerName+") needs CUDA: run on a GPU machine, or drop --peer", nil)
	}
	rep := &moeBenchReport{Backend: dev.Backend(), Device: dev.Info().Name, DType: dt.String(),
		Date: time.Now().UTC().Format("2006-01-02 15:04 UTC"), Commit: commit(), Command: commandLine(cmd),
		Seed: o.seed, Iters: o.iters, Warmup: o.warmup, Notes: []string{}}
	if cpu {
		if !changed("tokens") {
			o.tokens = cpuBenchTokens
		}
		if !changed("iters") {
			rep.Iters = cpuBenchIters
		}
		if !changed("warmup") {
			rep.Warmup = cpuBenchWarmup
		}
	}
	tokens, err := parseTokens(o.tokens)
	if err != nil {
		return nil, err
	}

	var w *moe.Weights
	if o.model != "" {
		var layer int
		if cfg, layer, err = resolveModel(o.model, o.layer); err != nil {
			return nil, err
		}
		if w, err = loadLayerWeights(o.model, cfg, layer); err != nil {
			return nil, err
		}
		rep.Model, rep.Layer = o.model, &layer
	} else {
		rep.Preset = o.preset
		if cpu && !o.fullSize {
			full := *cfg
			if cfg, err = scaleDown(cfg); err != nil {
				return nil, err
			}
			rep.ScaledDown = true
			rep.Notes = append(rep.Notes, fmt.Sprintf("CPU backend: preset %s scaled down from H=%d, E=%d, I=%d, shared=%d to H=%d, E=%d, I=%d, shared=%d (top-%d) so that the run takes seconds; --full-size keeps the real shape. CPU times say nothing about a GPU.",
				o.preset, full.HiddenSize, full.NumExperts, full.Intermediate, full.SharedIntermediate,
				cfg.HiddenSize, cfg.NumExperts, cfg.Intermediate, cfg.SharedIntermediate, cfg.TopK))
		}
		note, err := checkMemory(dev, cfg, dt, o.preset)
		if err != nil {
			return nil, err
		}
		if note != "" {
			rep.Notes = append(rep.Notes, note)
		}
		if w, err = moe.RandomWeights(cfg, o.seed); err != nil {
			return nil, fail("generating random weights", "", err)
		}
	}
	rep.Shape = benchShape{Family: string(cfg.Family), Hidden: cfg.HiddenSize, Experts: cfg.NumExperts, TopK: cfg.TopK,
		Intermediate: cfg.Intermediate, Shared: cfg.SharedIntermediate}
	for _, m := range modes {
		rep.Modes = append(rep.Modes, m.String())
	}

	hasShared := cfg.SharedIntermediate > 0
	steps := 2 + len(tokens)*(len(modes)+1+boolInt(hasShared))
	var bar *progressbar.ProgressBar
	if !a.json && stderrIsTerminal(a.errOut) {
		bar = progressbar.NewOptions(steps, progressbar.OptionSetWriter(a.errOut), progressbar.OptionSetWidth(30),
			progressbar.OptionShowCount(), progressbar.OptionClearOnFinish(), progressbar.OptionSetDescription("moe bench: ceilings"))
		defer bar.Finish()
	}
	step := func(desc string) {
		if bar != nil {
			bar.Describe("moe bench: " + desc)
			_ = bar.Add(1)
		}
	}

	// Ceilings, measured in this run.
	rep.CopyBytes, rep.GemmN = copyBytesCUDA, gemmNCUDA
	gemmPerRound := 5
	if cpu {
		rep.CopyBytes, rep.GemmN, gemmPerRound = copyBytesCPU, gemmNCPU, 1
	}
	if rep.CopyBW, err = bench.CopyBandwidth(dev, rep.CopyBytes, max(rep.Iters, 5)); err != nil {
		return nil, err
	}
	step("copy ceiling")
	if rep.GemmRate, err = bench.GemmRate(dev, rep.GemmN, dt, gemmPerRound, min(max(rep.Iters, 3), 10)); err != nil {
		return nil, err
	}
	step("GEMM ceiling")

	l, err := moe.NewLayer(dev, cfg, w, moe.LayerOptions{DType: dt, Mode: modes[0], AutoThreshold: moe.DefaultAutoThreshold, SmallBatchTokens: o.smallBatch, NoGraphs: o.noGraphs, NoFused: o.noFused, Tile: o.tile})
	if err != nil {
		return nil, fail("building the MoE layer on the device", "try fewer experts (another preset) or --dtype bf16", err)
	}
	defer l.Close()
	timer, err := bench.NewTimer(dev, l.MainStream())
	if err != nil {
		return nil, fail("creating timing events", "", err)
	}
	defer timer.Close()
	var reads []readFile
	if o.model != "" {
		if reads, err = modelFiles(o.model); err != nil {
			return nil, err
		}
	}
	tr, err := startTrace(dev, o.trace, reads, map[string]string{
		"command": commandLine(cmd), "preset": rep.Preset, "model": rep.Model, "dtype": dt.String(),
		"graphs": "off: --trace runs the layer eagerly (moe.LayerOptions.NoGraphs), for the timings too, so that every kernel is a span",
		"traced": "after each token count's timings, one forward per mode (the timed runs are not traced)",
	})
	if err != nil {
		return nil, err
	}
	tr.pause() // only the forwards benchTokens traces
	if tr != nil {
		tr.tr.NameStream(l.MainStream(), "main stream (router, routed experts, combine)")
		tr.tr.NameStream(l.SideStream(), "side stream (shared expert in dual mode)")
		rep.Notes = append(rep.Notes, "--trace: every forward ran eagerly (no graphs)")
	}

	for _, T := range tokens {
		row, err := a.benchTokens(l, dev, timer, cfg, dt, modes, T, o.seed, rep.Iters, rep.Warmup, step, tr)
		if err != nil {
			return nil, err
		}
		f := bench.NewFloor(row.WeightBytes, row.FLOPs, rep.CopyBW, rep.GemmRate)
		row.BytesFloorUS, row.ComputeFloorUS, row.FloorUS, row.Bound = f.BytesUS, f.ComputeUS, f.US, f.Bound
		row.PctOfFloor = 100 * row.FloorUS / row.MedianUS[row.Best]
		rep.Rows = append(rep.Rows, row)
	}
	if bar != nil {
		_ = bar.Finish()
	}
	if err := a.finishTrace(tr); err != nil {
		return nil, err
	}
	for _, line := range l.TileChoices() {
		rep.Notes = append(rep.Notes, "fused tiles: "+line)
	}
	return rep, nil
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// benchTokens times every variant for T tokens on fresh random inputs.
func (a *app) benchTokens(l *moe.Layer, dev *gpuctx.Device, timer *bench.Timer, cfg *moe.Config, dt gpuctx.DType,
	modes []moe.Mode, T int, seed uint64, iters, warmup int, step func(string), tr *traceRun) (benchRow, error) {
	H := cfg.HiddenSize
	row := benchRow{Tokens: T, MedianUS: map[string]float64{}}
	r := rand.New(rand.NewPCG(seed, uint64(T)+1000))
	host := bench.Encode(bench.RandVec(r, T*H), dt)
	x, err := dev.Alloc(len(host))
	if err != nil {
		return row, fail(fmt.Sprintf("allocating the input for %d tokens", T), "use fewer --tokens", err)
	}
	defer x.Free()
	if err := x.CopyFromHost(host); err != nil {
		return row, err
	}
	y, err := dev.Alloc(len(host))
	if err != nil {
		return row, fail(fmt.Sprintf("allocating the output for %d tokens", T), "use fewer --tokens", err)
	}
	defer y.Free()
	variant := func(name string, m moe.Mode, p moe.Part) (float64, error) {
		sec, err := timer.Median(warmup, iters, func() error { return l.ForwardDevice(x, y, T, m, p) })
		if err != nil {
			return 0, fail(fmt.Sprintf("timing %s for %d tokens", name, T), "check 'gpuctx info'; try --backend cpu to compare", err)
		}
		step(fmt.Sprintf("T=%d %s", T, name))
		return sec * 1e6, nil
	}
	for i, m := range modes {
		us, err := variant(m.String(), m, moe.Whole)
		if err != nil {
			return row, err
		}
		row.MedianUS[m.String()] = us
		if row.Best == "" || us < row.MedianUS[row.Best] {
			row.Best = m.String()
		}
		if i == 0 {
			idx, _, err := l.LastRouting()
			if err != nil {
				return row, fail("reading the routing of the batch", "", err)
			}
			row.WeightBytes = l.WeightBytes(T, idx)
		}
	}
	if tr != nil { // one traced forward per mode, after the timings
		for _, m := range modes {
			tr.resume()
			end := tr.tr.Range(l.MainStream(), fmt.Sprintf("moe forward T=%d %s", T, m))
			err := l.ForwardDevice(x, y, T, m, moe.Whole)
			end()
			tr.pause()
			if err == nil {
				err = l.MainStream().Synchronize()
			}
			if err != nil {
				return row, fail(fmt.Sprintf("the traced %s forward for %d tokens", m, T), "", err)
			}
		}
	}
	row.FLOPs = batchFLOPs(cfg, T)
	if cfg.SharedIntermediate > 0 {
		us, err := variant("shared alone", moe.Single, moe.SharedOnly)
		if err != nil {
			return row, err
		}
		row.SharedUS = &us
	}
	if row.RoutedUS, err = variant("routed alone", moe.Single, moe.RoutedOnly); err != nil {
		return row, err
	}
	single, ok1 := row.MedianUS[moe.Single.String()]
	dual, ok2 := row.MedianUS[moe.Dual.String()]
	if ok1 && ok2 && row.SharedUS != nil {
		ov := (single - dual) / min(*row.SharedUS, row.RoutedUS)
		row.Overlap = &ov
	}
	if fused, ok := row.MedianUS[moe.FusedShared.String()]; ok1 && ok && row.SharedUS != nil {
		ov := (single - fused) / min(*row.SharedUS, row.RoutedUS)
		row.FusedOverlap = &ov
	}
	return row, nil
}

// fmtUS formats microseconds with about three significant digits.
func fmtUS(v float64) string {
	switch {
	case v < 10:
		return fmt.Sprintf("%.2f", v)
	case v < 1000:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.0f", v)
}

// markdown renders the header and the aligned table.
func (r *moeBenchReport) markdown() string {
	var b strings.Builder
	name := r.Preset
	if r.Model != "" {
		name = fmt.Sprintf("%s layer %d", r.Model, *r.Layer)
	} else if r.ScaledDown {
		name += " (scaled down for the CPU backend)"
	}
	s := r.Shape
	fmt.Fprintf(&b, "### MoE layer: %s, %s, %s\n\n", name, r.DType, r.Device)
	fmt.Fprintf(&b, "- device: %s (backend %s)\n", r.Device, r.Backend)
	fmt.Fprintf(&b, "- date: %s; commit: %s\n", r.Date, r.Commit)
	fmt.Fprintf(&b, "- command: `%s`\n", r.Command)
	weights := fmt.Sprintf("random (seed %d)", r.Seed)
	if r.Model != "" {
		weights = "from " + r.Model
	}
	fmt.Fprintf(&b, "- layer: %s, H=%d, E=%d, top-%d, I=%d, shared=%d; weights %s; dtype %s\n",
		s.Family, s.Hidden, s.Experts, s.TopK, s.Intermediate, s.Shared, weights, r.DType)
	fmt.Fprintf(&b, "- ceilings measured in this run: copy %.3g GB/s (%d MiB device-to-device, read+write), GEMM %.3g TFLOP/s (%s %d³ through a Context)\n",
		r.CopyBW/1e9, r.CopyBytes>>20, r.GemmRate/1e12, r.DType, r.GemmN)
	fmt.Fprintf(&b, "- latency: median of %d forwards after %d warm-up, device events around Layer.ForwardDevice on the layer's main stream, in µs\n", r.Iters, r.Warmup)
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "- note: %s\n", n)
	}
	// On the CPU backend the "streams" of single and dual mode take turns on
	// the same cores and the ceilings are the host's: overlap and % of floor
	// come out as numbers that mean nothing (negative, or far above 100%).
	cpu := r.Backend == "cpu"
	if cpu {
		b.WriteString("- note: CPU backend: the overlap and % of floor columns are left out: the side stream's work shares the same host cores and the ceilings are the host's, so they would be meaningless numbers (--json keeps them)\n")
	}
	if p := r.Peer; p != nil {
		status := "ok"
		if !p.OK {
			status = "FAILED: " + p.Error
		}
		fmt.Fprintf(&b, "- peer: %s, run after gpuctx in the same invocation: `%s`; %s\n", p.Name, p.Command, status)
	}
	b.WriteString("\n")
	head := []string{"tokens", "floor µs", "bound"}
	for _, m := range r.Modes {
		head = append(head, m+" µs")
	}
	head = append(head, "shared µs", "routed µs")
	fusedCol := false
	for _, row := range r.Rows {
		fusedCol = fusedCol || row.FusedOverlap != nil
	}
	if !cpu {
		head = append(head, "overlap")
		if fusedCol {
			head = append(head, "fused overlap")
		}
		head = append(head, "% of floor")
	}
	head = append(head, "weights MiB", "GFLOP")
	if r.Peer != nil {
		head = append(head, "peer µs (best mode)", "vs peer")
	}
	rows := [][]string{head}
	for _, row := range r.Rows {
		line := []string{strconv.Itoa(row.Tokens), fmtUS(row.FloorUS), row.Bound}
		for _, m := range r.Modes {
			v := fmtUS(row.MedianUS[m])
			if m == row.Best && len(r.Modes) > 1 {
				v += "*"
			}
			line = append(line, v)
		}
		sh, ov := "-", "-"
		if row.SharedUS != nil {
			sh = fmtUS(*row.SharedUS)
		}
		if row.Overlap != nil {
			ov = fmt.Sprintf("%.2f", *row.Overlap)
		}
		line = append(line, sh, fmtUS(row.RoutedUS))
		if !cpu {
			line = append(line, ov)
			if fusedCol {
				fo := "-"
				if row.FusedOverlap != nil {
					fo = fmt.Sprintf("%.2f", *row.FusedOverlap)
				}
				line = append(line, fo)
			}
			line = append(line, fmt.Sprintf("%.1f%%", row.PctOfFloor))
		}
		line = append(line, fmt.Sprintf("%.1f", float64(row.WeightBytes)/(1<<20)), fmt.Sprintf("%.3g", row.FLOPs/1e9))
		if r.Peer != nil {
			pu, sp := "-", "-"
			if row.PeerBestUS != nil {
				pu = fmtUS(*row.PeerBestUS) + " (" + row.PeerBestMode + ")"
			}
			if row.SpeedupVsPeer != nil {
				sp = fmtSpeedup(*row.SpeedupVsPeer)
			}
			line = append(line, pu, sp)
		}
		rows = append(rows, line)
	}
	writeTable(&b, rows)
	if cpu {
		b.WriteString("\nfloor = max(weight bytes touched / copy bandwidth, FLOPs / GEMM rate); * = best mode.\n")
	} else {
		b.WriteString("\nfloor = max(weight bytes touched / copy bandwidth, FLOPs / GEMM rate); % of floor = floor / best mode (*); " +
			"overlap = (single - dual) / min(shared, routed), 1 = the shared expert fully hidden; fused overlap = (single - fused) / min(shared, routed).\n")
	}
	if r.Peer != nil {
		b.WriteString("peer µs = the peer's fastest mode (median); vs peer = peer best / gpuctx best (*), >1 = gpuctx faster.\n")
		b.WriteString(r.peerSummary() + "\n")
	}
	return b.String()
}

// writeTable writes rows (the first is the header) as an aligned markdown
// table: the first column left-aligned, the others right-aligned.
func writeTable(w io.Writer, rows [][]string) {
	width := make([]int, len(rows[0]))
	for _, r := range rows {
		for i, c := range r {
			width[i] = max(width[i], len([]rune(c)), 3)
		}
	}
	pad := func(s string, n int, left bool) string {
		gap := strings.Repeat(" ", n-len([]rune(s)))
		if left {
			return s + gap
		}
		return gap + s
	}
	for ri, r := range rows {
		cells := make([]string, len(r))
		for i, c := range r {
			cells[i] = pad(c, width[i], i == 0)
		}
		fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
		if ri == 0 {
			for i := range cells {
				if i == 0 {
					cells[i] = strings.Repeat("-", width[i])
				} else {
					cells[i] = strings.Repeat("-", width[i]-1) + ":"
				}
			}
			fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
		}
	}
}
