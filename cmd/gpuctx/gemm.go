package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/bench"
)

func init() { register(newGemmCmd) }

type gemmOpts struct {
	m, n, k       int
	dtype         string
	streams       int
	iters, warmup int
	repeats       int
	policy        string
	sets          int
	check         bool
	lt            bool
	fullSize      bool
	trace         string
}

// On the CPU backend gemm caps each dimension at cpuGemmDim and, unless set,
// runs cpuGemmIters GEMMs per round, cpuGemmRepeats rounds and cpuGemmWarmup
// warm-up GEMMs, so that a command meant for a GPU (8192³ takes hours on two
// cores) finishes in seconds. --full-size keeps the shape asked for.
const (
	cpuGemmDim     = 512
	cpuGemmIters   = 3
	cpuGemmRepeats = 3
	cpuGemmWarmup  = 1
)

type gemmReport struct {
	Backend   string    `json:"backend"`
	Device    string    `json:"device"`
	M         int       `json:"m"`
	N         int       `json:"n"`
	K         int       `json:"k"`
	DType     string    `json:"dtype"`
	Streams   int       `json:"streams"`
	Iters     int       `json:"iters_per_stream"`
	Policy    string    `json:"policy"`
	Path      string    `json:"path"`
	TFLOPS    float64   `json:"tflops_all"`
	PerStream []float64 `json:"tflops_per_stream"`
	MedianUS  float64   `json:"median_us_per_gemm"`
	MaxRelErr float64   `json:"max_rel_err_sampled"`
	Checked   int       `json:"entries_checked"`
	// ScaledDown is true when the CPU backend shrank the shape or the
	// iteration counts; Note says from what to what.
	ScaledDown bool   `json:"scaled_down"`
	Note       string `json:"note,omitempty"`
}

func newGemmCmd(a *app) *cobra.Command {
	o := gemmOpts{}
	cmd := &cobra.Command{
		Use:   "gemm",
		Short: "Time GEMMs through gpuctx Contexts on one or several streams (TFLOP/s)",
		Long: `gemm runs C = A*B (row-major, M×K times K×N) through gpuctx BLAS Contexts:
one Context view per stream, each stream with its own A, B and C (several sets
rotated so that small problems do not sit in L2), random data, warm-up first,
then the median of --repeats timed rounds of --iters GEMMs per stream, timed
with device events. It prints the rate for all streams together and for each
stream (TFLOP/s, or GFLOP/s below 1 TFLOP/s), and checks sampled entries of C
against a float64 host reference. Progress goes to stderr: a bar on a terminal,
else one line per step.

The default sizes and the examples are GPU sizes. On the CPU backend (no GPU,
or --backend cpu) gemm caps M, N and K at 512 and, unless they are set, runs 1
warm-up, 3 rounds of 3 GEMMs, and says so in its output, so that it finishes
in seconds; --full-size keeps the shape asked for (8192³ on two cores takes
hours).

dtype: f32, tf32 (f32 with TF32 tensor-core math), bf16, f16 (f32 accumulate,
output in the input type), f64.`,
		Example: `  gpuctx gemm --m 8192 --n 8192 --k 8192 --dtype bf16
  gpuctx gemm --m 4096 --n 4096 --k 4096 --dtype f32 --streams 4 --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return a.runGemm(cmd, o) },
	}
	f := cmd.Flags()
	f.IntVar(&o.m, "m", 4096, "rows of A and C")
	f.IntVar(&o.n, "n", 4096, "columns of B and C")
	f.IntVar(&o.k, "k", 4096, "columns of A, rows of B")
	f.StringVar(&o.dtype, "dtype", "f32", "element type: f32, tf32, bf16, f16, f64")
	f.IntVar(&o.streams, "streams", 1, "streams (one goroutine and Context view each)")
	f.IntVar(&o.iters, "iters", 20, "GEMMs per stream per timed round")
	f.IntVar(&o.warmup, "warmup", 5, "untimed GEMMs per stream first")
	f.IntVar(&o.repeats, "repeats", 5, "timed rounds; the median is reported")
	f.StringVar(&o.policy, "policy", "pooled", "handle policy: pooled or shared")
	f.IntVar(&o.sets, "sets", 0, "operand sets per stream rotated between GEMMs (0: enough to exceed 256 MiB)")
	f.BoolVar(&o.lt, "lt", false, "use the cuBLASLt path (Context.BlasLt) instead of cuBLAS (f32, bf16, f16)")
	f.BoolVar(&o.check, "check", true, "check sampled entries of C against a float64 reference")
	f.StringVar(&o.trace, "trace", "", traceHelp+"; one extra untimed round (--iters GEMMs per stream) is traced after the timed rounds")
	f.BoolVar(&o.fullSize, "full-size", false, "on the CPU backend, keep --m/--n/--k and the iteration counts (slow: 8192³ takes hours)")
	return cmd
}

func (o *gemmOpts) validate() error {
	for _, v := range []struct {
		name string
		val  int
	}{{"--m", o.m}, {"--n", o.n}, {"--k", o.k}, {"--streams", o.streams}, {"--iters", o.iters}, {"--repeats", o.repeats}} {
		if v.val < 1 {
			return fail(fmt.Sprintf("%s %d must be >= 1", v.name, v.val), "pass a positive number", nil)
		}
	}
	if o.warmup < 0 || o.sets < 0 {
		return fail("--warmup and --sets must be >= 0", "pass 0 or more", nil)
	}
	switch o.dtype {
	case "f32", "tf32", "bf16", "f16", "f64":
	default:
		return fail(fmt.Sprintf("--dtype %q is not supported", o.dtype), "use f32, tf32, bf16, f16 or f64", nil)
	}
	if o.lt && (o.dtype == "f64" || o.dtype == "tf32") {
		return fail(fmt.Sprintf("--lt does not support --dtype %s", o.dtype), "use f32, bf16 or f16 with --lt", nil)
	}
	if o.policy != "pooled" && o.policy != "shared" {
		return fail(fmt.Sprintf("--policy %q is not a policy", o.policy), "use pooled or shared", nil)
	}
	return nil
}

func (o *gemmOpts) types() (gpuctx.DType, gpuctx.Flavour) {
	switch o.dtype {
	case "tf32":
		return gpuctx.F32, gpuctx.TF32
	case "bf16":
		return gpuctx.BF16, gpuctx.TensorOp
	case "f16":
		return gpuctx.F16, gpuctx.TensorOp
	case "f64":
		return gpuctx.F64, gpuctx.Default
	}
	return gpuctx.F32, gpuctx.Default
}

// scaleForCPU shrinks o for the CPU backend (see cpuGemmDim) and returns a
// note saying what changed, or "" when nothing did.
func (o *gemmOpts) scaleForCPU(changed func(string) bool) string {
	if o.fullSize {
		return ""
	}
	var did []string
	if o.m > cpuGemmDim || o.n > cpuGemmDim || o.k > cpuGemmDim {
		did = append(did, fmt.Sprintf("shape %d×%d×%d to %d×%d×%d", o.m, o.n, o.k,
			min(o.m, cpuGemmDim), min(o.n, cpuGemmDim), min(o.k, cpuGemmDim)))
		o.m, o.n, o.k = min(o.m, cpuGemmDim), min(o.n, cpuGemmDim), min(o.k, cpuGemmDim)
	}
	for _, c := range []struct {
		flag string
		v    *int
		cpu  int
	}{{"iters", &o.iters, cpuGemmIters}, {"repeats", &o.repeats, cpuGemmRepeats}, {"warmup", &o.warmup, cpuGemmWarmup}} {
		if !changed(c.flag) && *c.v > c.cpu {
			did = append(did, fmt.Sprintf("--%s %d to %d", c.flag, *c.v, c.cpu))
			*c.v = c.cpu
		}
	}
	if len(did) == 0 {
		return ""
	}
	return "CPU backend: scaled down (" + strings.Join(did, ", ") + ") so that the run takes seconds; --full-size keeps them. CPU rates say nothing about a GPU."
}

// flopRate formats a rate given in TFLOP/s with three significant digits,
// in GFLOP/s below 1 TFLOP/s (the CPU backend's range).
func flopRate(tflops float64) string {
	if tflops >= 1 || tflops == 0 {
		return fmt.Sprintf("%.3g TFLOP/s", tflops)
	}
	return fmt.Sprintf("%.3g GFLOP/s", tflops*1e3)
}

func (a *app) runGemm(cmd *cobra.Command, o gemmOpts) error {
	if err := o.validate(); err != nil {
		return err
	}
	if o.trace != "" {
		if err := checkOutput("--trace", o.trace, nil); err != nil {
			return err
		}
	}
	rt, dev, err := a.openDevice()
	if err != nil {
		return err
	}
	defer rt.Close()
	var note string
	if dev.Backend() == "cpu" {
		note = o.scaleForCPU(cmd.Flags().Changed)
	}
	t, flavour := o.types()
	policy := gpuctx.PooledHandles
	if o.policy == "shared" {
		policy = gpuctx.SharedHandle
	}
	pr := a.newStepProgress("gemm")
	bo := bench.GemmOptions{M: o.m, N: o.n, K: o.k, DType: t, Flavour: flavour, Lt: o.lt, Policy: policy, Streams: o.streams,
		Iters: o.iters, Warmup: o.warmup, Repeats: o.repeats, Sets: o.sets, Check: o.check, Progress: pr}
	g, err := bench.NewGemmBench(dev, bo)
	if err != nil {
		return err
	}
	defer g.Close()
	pr.Begin(bench.GemmSteps(bo), "warm-up")
	res, err := g.Run()
	pr.End()
	if err != nil {
		return err
	}
	if err := a.traceGemm(cmd, dev, g, o); err != nil {
		return err
	}
	rep := gemmReport{Backend: dev.Backend(), Device: dev.Info().Name, M: o.m, N: o.n, K: o.k, DType: o.dtype,
		Streams: o.streams, Iters: o.iters, Policy: o.policy, Path: map[bool]string{false: "blas", true: "blasLt"}[o.lt],
		TFLOPS: res.TFLOPS, PerStream: res.PerStream, MedianUS: res.MedianUS, MaxRelErr: res.MaxRelErr, Checked: res.Checked,
		ScaledDown: note != "", Note: note}
	if tol := map[string]float64{"f32": 1e-4, "tf32": 5e-3, "bf16": 2e-2, "f16": 1e-2, "f64": 1e-10}[o.dtype]; o.check && !(rep.MaxRelErr <= tol) {
		return fail(fmt.Sprintf("GEMM result wrong: sampled relative error %.3g > %.1g", rep.MaxRelErr, tol), "report this with 'gpuctx info' output", nil)
	}
	if a.json {
		return a.jsonOut(rep)
	}
	printGemm(a.out, rep, o)
	return nil
}

// traceGemm runs one more round, untimed, with a tracer attached (--trace).
func (a *app) traceGemm(cmd *cobra.Command, dev *gpuctx.Device, g *bench.GemmBench, o gemmOpts) error {
	if o.trace == "" {
		return nil
	}
	tr, err := startTrace(dev, o.trace, nil, map[string]string{"command": commandLine(cmd),
		"traced": fmt.Sprintf("one untimed round after the timed ones: %d GEMMs on each of %d streams", o.iters, o.streams)})
	if err != nil {
		return err
	}
	for s, st := range g.Streams() {
		tr.tr.NameStream(st, fmt.Sprintf("stream %d (Context view %d)", s, s))
	}
	if _, _, err := g.Round(); err != nil {
		tr.pause()
		return err
	}
	return a.finishTrace(tr)
}

// printGemm prints the text report.
func printGemm(w io.Writer, rep gemmReport, o gemmOpts) {
	fmt.Fprintf(w, "gemm (%s) on %s (%s): C[%d×%d] = A[%d×%d]·B[%d×%d], %s, %d stream(s), %s handles\n",
		rep.Path, rep.Device, rep.Backend, o.m, o.n, o.m, o.k, o.k, o.n, o.dtype, o.streams, o.policy)
	if rep.Note != "" {
		fmt.Fprintf(w, "note: %s\n", rep.Note)
	}
	fmt.Fprintf(w, "all streams: %s (median of %d rounds of %d GEMMs per stream; %.1f µs per GEMM on each stream)\n",
		flopRate(rep.TFLOPS), o.repeats, o.iters, rep.MedianUS)
	for s, v := range rep.PerStream {
		fmt.Fprintf(w, "  stream %d: %s\n", s, flopRate(v))
	}
	if o.check {
		fmt.Fprintf(w, "check: %d sampled entries, max relative error %.2g\n", rep.Checked, rep.MaxRelErr)
	}
}
