package main

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe"
)

// phases accumulates the wall time of a command's phases (moe run -v). A
// phase may be entered more than once; time is charged to the current one.
type phases struct {
	d    map[string]time.Duration
	cur  string
	t    time.Time
	prog *progress // reports long phases (nil: none)
}

// begin ends the current phase and starts name.
func (p *phases) begin(name string) {
	p.charge()
	p.cur = name
	label, what := progressLabel(name)
	p.prog.phase(label, what)
}

// charge adds the current phase's time up to now to it.
func (p *phases) charge() {
	now := time.Now()
	if p.d == nil {
		p.d = map[string]time.Duration{}
	}
	if p.cur != "" {
		p.d[p.cur] += now.Sub(p.t)
	}
	p.t = now
}

// end ends the current phase and the progress report.
func (p *phases) end() {
	p.begin("")
	p.prog.finish()
}

// move recharges d of phase from's time to phase to (time measured inside
// from that belongs to to, such as kernel compilation inside NewLayer).
func (p *phases) move(from, to string, d time.Duration) {
	p.charge()
	d = min(d, p.d[from])
	p.d[from] -= d
	p.d[to] += d
}

// moeRunPhases are moe run's phases in print order, with what each covers.
var moeRunPhases = []struct{ name, what string }{
	{"open", "backend and device 0"},
	{"parse", "config.json, safetensors headers, the input x"},
	{"load", "weights read and uploaded (converted where the file's dtype is not --dtype)"},
	{"compile", "kernel lookups and compilation"},
	{"blas", "waiting for the BLAS warm-up (library and GEMM kernels loaded while the weights upload)"},
	{"forward", "one forward, host in and out, kernel lookups excluded"},
	{"trace", "reading the timing events, writing --trace"},
	{"write", "encoding and writing --output"},
}

// progressLabel is how progress names phase name and what it does: the load
// phase is reported as "load and compile", since the kernel lookups inside
// LoadLayer (compiled on a machine's first run) are only moved to the compile
// phase of -v's breakdown once the load has ended.
func progressLabel(name string) (label, what string) {
	if name == "load" {
		return "load and compile", "weights read and uploaded, kernels looked up (compiled by NVRTC on a machine's first run)"
	}
	return name, phaseWhat(name)
}

// phaseWhat is what moe run's phase name covers ("" for an unknown name).
func phaseWhat(name string) string {
	for _, ph := range moeRunPhases {
		if ph.name == name {
			return ph.what
		}
	}
	return ""
}

// print writes the breakdown to w: one line per phase, then the total.
// notes replaces the description of the phases it names (the compile
// phase's is generic otherwise).
func (p *phases) print(w io.Writer, notes map[string]string, backend string) {
	var total time.Duration
	fmt.Fprintf(w, "wall time (%s backend):\n", backend)
	for _, ph := range moeRunPhases {
		d, ok := p.d[ph.name]
		if !ok {
			continue
		}
		what := ph.what
		if n, ok := notes[ph.name]; ok {
			what = n
		}
		total += d
		fmt.Fprintf(w, "  %-8s %10.1f ms  %s\n", ph.name, float64(d.Microseconds())/1e3, what)
	}
	fmt.Fprintf(w, "  %-8s %10.1f ms\n", "total", float64(total.Microseconds())/1e3)
}

// forwardNote describes moe run's forward phase: on CUDA a bf16 (or FP8)
// layer's fused expert GEMMs pick their tiles by rule of thumb unless
// --autotune times them (which the forward then includes), unless the tiles
// came from the disk cache of tuning results (cached).
func forwardNote(backend string, dt gpuctx.DType, autotune, cached bool) string {
	const what = "one forward, host in and out, kernel lookups excluded"
	switch {
	case backend != "cuda" || dt != gpuctx.BF16:
		return what
	case autotune && cached:
		return what + "; fused GEMM tiles from the tuning cache (--autotune; GPUCTX_KERNEL_CACHE=off times them)"
	case autotune:
		return what + "; includes timing the fused GEMM tiles (--autotune)"
	}
	return what + "; fused GEMM tiles by rule of thumb (--autotune times them)"
}

// kernelNote says where the kernels between two KernelStats came from.
func kernelNote(dev *gpuctx.Device, before, after gpuctx.KernelStats) string {
	n := after.Lookups - before.Lookups
	hits, compiled := after.CacheHits-before.CacheHits, after.Compiled-before.Compiled
	var b strings.Builder
	fmt.Fprintf(&b, "%d kernel lookups", n)
	switch {
	case dev.Backend() == "cpu":
		b.WriteString(" (CPU backend: built in, nothing to compile)")
	case hits == 0 && compiled == 0:
		b.WriteString(" (all already loaded in this process)")
	default:
		fmt.Fprintf(&b, "; source files: %d from the disk cache, %d compiled by NVRTC", hits, compiled)
		if after.CacheDir == "" {
			b.WriteString(" (disk cache off: GPUCTX_KERNEL_CACHE=off)")
		} else {
			fmt.Fprintf(&b, " (cache %s)", after.CacheDir)
		}
	}
	return b.String()
}

// warmBlas loads the device's BLAS library and creates a handle, so that
// loading cuBLAS (a large library) is charged to opening the device rather than
// to the first forward. Errors are left for the forward to report.
func warmBlas(dev *gpuctx.Device) {
	ctx, err := dev.NewContext(gpuctx.ContextOptions{})
	if err != nil {
		return
	}
	_ = ctx.Blas(func(gpuctx.Blas) error { return nil })
	_ = ctx.Close()
}

// startBlasWarmup loads the BLAS library and runs the shared expert's GEMM
// shapes for T tokens once (on zeroed scratch, on a stream of its own
// Context) in a goroutine, and returns a function that waits for it and
// reports how long the warm-up took (any number of calls; the caller must
// call it before closing dev). cuBLAS loads a GEMM's kernels at its first
// call, which on the H200 made the first forward of moe run 120 ms slower
// than with the shared expert fused (bench/RESULTS.md); started before the
// weights are loaded, that cost overlaps the upload. The layer's own
// handles then find the library and kernels loaded. A bf16 (or FP8) layer's
// shared expert runs bf16 GEMMs on the tensor-op handles, an f32 layer's f32
// GEMMs. Errors are left for the forward to report; a layer without a shared
// expert warms only the library.
func startBlasWarmup(dev *gpuctx.Device, cfg *moe.Config, T int, dt gpuctx.DType) (wait func() time.Duration) {
	if dev.Backend() == "cpu" { // nothing to load; the GEMMs would only cost time
		warmBlas(dev)
		return func() time.Duration { return 0 }
	}
	done := make(chan time.Duration, 1)
	go func() {
		t0 := time.Now()
		defer func() { done <- time.Since(t0) }()
		if err := blasWarmup(dev, cfg, T, dt); err != nil {
			warmBlas(dev)
		}
	}()
	return sync.OnceValue(func() time.Duration { return <-done })
}

// blasWarmup is startBlasWarmup's work, on the calling goroutine: it returns
// once the GEMMs have run (their Context's stream synchronized).
func blasWarmup(dev *gpuctx.Device, cfg *moe.Config, T int, dt gpuctx.DType) error {
	flav := gpuctx.Default
	if dt != gpuctx.F32 {
		dt, flav = gpuctx.BF16, gpuctx.TensorOp
	}
	H, Is := cfg.HiddenSize, cfg.SharedIntermediate
	if Is == 0 || T <= 0 {
		return errors.New("no shared expert")
	}
	ctx, err := dev.NewContext(gpuctx.ContextOptions{})
	if err != nil {
		return err
	}
	defer ctx.Close()
	es := dt.Size()
	var bufs []*gpuctx.Buffer
	defer func() {
		for _, b := range bufs {
			_ = b.Free()
		}
	}()
	alloc := func(n int) (*gpuctx.Buffer, error) {
		b, err := dev.Alloc(n * es)
		if err == nil {
			bufs = append(bufs, b)
			err = ctx.Stream().Memset(b, 0)
		}
		return b, err
	}
	x, err1 := alloc(T * H)
	w, err2 := alloc(2 * Is * H)
	h, err3 := alloc(T * 2 * Is)
	y, err4 := alloc(T * H)
	if err := errors.Join(err1, err2, err3, err4); err != nil {
		return err
	}
	err = ctx.BlasFlavour(flav, func(b gpuctx.Blas) error {
		return errors.Join(
			b.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: 2 * Is, K: H, Alpha: 1, A: x, B: w, C: h, AB: dt, CType: dt}),
			b.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: H, K: Is, Alpha: 1, A: h, B: w, C: y, AB: dt, CType: dt}))
	})
	return errors.Join(err, ctx.Stream().Synchronize())
}

// blasNote describes moe run's blas phase (not on the CPU backend, which
// warms nothing): the wait for startBlasWarmup beyond the load it ran
// beside, and how long the warm-up itself took.
func blasNote(warm time.Duration) string {
	return fmt.Sprintf("waiting for the BLAS warm-up (cuBLAS and the shared expert's GEMM kernels loaded, %.1f ms in all, beside load and compile)",
		float64(warm.Microseconds())/1e3)
}
