package main

import (
	"fmt"
	"io"
	"time"

	"github.com/schollz/progressbar/v3"
)

// stepProgress shows the steps of a long run (moe bench, gemm) on stderr: a bar
// when stderr is a terminal, else one plain line per step ("moe bench: [3/20]
// T=8 dual (4.1 s)"), with --json too, so that a run without a terminal
// still shows it is alive. It implements bench.Progress.
type stepProgress struct {
	w           io.Writer
	name        string
	bar         *progressbar.ProgressBar
	total, done int
	start       time.Time
}

// newStepProgress returns the progress of command name on a.errOut.
func (a *app) newStepProgress(name string) *stepProgress {
	return &stepProgress{w: a.errOut, name: name, start: time.Now()}
}

// Begin starts a run of total steps.
func (p *stepProgress) Begin(total int, what string) {
	p.total, p.done = total, 0
	if writerIsTerminal(p.w) {
		p.bar = progressbar.NewOptions(total, progressbar.OptionSetWriter(p.w), progressbar.OptionSetWidth(30),
			progressbar.OptionShowCount(), progressbar.OptionClearOnFinish(), progressbar.OptionSetDescription(p.name+": "+what))
		return
	}
	fmt.Fprintf(p.w, "%s: %s (%d steps)\n", p.name, what, total)
}

// Step reports one step done.
func (p *stepProgress) Step(desc string) {
	p.done++
	if p.bar != nil {
		p.bar.Describe(p.name + ": " + desc)
		_ = p.bar.Add(1)
		return
	}
	fmt.Fprintf(p.w, "%s: [%d/%d] %s (%.1f s)\n", p.name, p.done, p.total, desc, time.Since(p.start).Seconds())
}

// End clears the bar (plain lines stay).
func (p *stepProgress) End() {
	if p.bar != nil {
		_ = p.bar.Finish()
		p.bar = nil
	}
}
