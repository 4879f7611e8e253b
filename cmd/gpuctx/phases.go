package main

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/gpuctx/gpuctx"
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
	p.prog.phase(name, phaseWhat(name))
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
	{"open", "backend, device 0 and the BLAS library (first handle)"},
	{"parse", "config.json, safetensors headers, the input x"},
	{"load", "weights read and uploaded (converted where the file's dtype is not --dtype)"},
	{"compile", "kernel lookups and compilation"},
	{"forward", "one forward, host in and out, kernel lookups excluded"},
	{"trace", "reading the timing events, writing --trace"},
	{"write", "encoding and writing --output"},
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

// forwardNote describes moe run's forward phase: on CUDA a bf16 layer's fused
// expert GEMMs pick their tiles by rule of thumb unless --autotune times them
// (which the forward then includes), unless the tiles came from the disk
// cache of tuning results (cached).
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
