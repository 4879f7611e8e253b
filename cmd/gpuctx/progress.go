package main

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
)

// progressDelay is how long a phase runs before progress shows it: runs
// shorter than that print nothing. Tests lengthen it so that a slow machine
// does not add lines to the output they compare.
var progressDelay = 500 * time.Millisecond

// serialWriter serialises writes to w: progress writes from a timer while the
// command writes from its own goroutine.
type serialWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *serialWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

// progress reports the long phases of a command on stderr (w): on a terminal
// as a progress bar over the phases, elsewhere (a file, a pipe, CI) as plain
// lines, one when a phase has run for delay and one when it ends. It prints
// with --json too: its output goes to stderr, never into the JSON. A nil
// *progress reports nothing.
type progress struct {
	w      io.Writer
	prefix string // "moe run"
	delay  time.Duration
	tty    bool
	steps  int // phases in all, for the bar

	mu      sync.Mutex
	timer   *time.Timer
	bar     *progressbar.ProgressBar
	name    string    // the current phase
	what    string    // what it does
	started time.Time // when it started
	shown   bool      // its start was reported
	seq     int       // counts phases, so that a late timer of an ended phase does nothing
	done    int       // phases ended
}

// newProgress returns a reporter of steps phases writing to *w, and replaces
// *w with a writer that serialises the command's writes with the reporter's.
func newProgress(w *io.Writer, prefix string, steps int) *progress {
	tty := writerIsTerminal(*w)
	*w = &serialWriter{w: *w}
	return &progress{w: *w, prefix: prefix, delay: progressDelay, tty: tty, steps: steps}
}

// writerIsTerminal reports whether w is a character device (a terminal).
func writerIsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// phase ends the current phase and starts name, which does what.
func (p *progress) phase(name, what string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.endLocked()
	p.name, p.what, p.started, p.shown = name, what, time.Now(), false
	p.seq++
	if name == "" {
		return
	}
	seq := p.seq
	p.timer = time.AfterFunc(p.delay, func() { p.show(seq) })
}

// finish ends the current phase and clears the bar.
func (p *progress) finish() {
	if p == nil {
		return
	}
	p.phase("", "")
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bar != nil {
		_ = p.bar.Finish()
		p.bar = nil
	}
}

// show reports phase seq once it has run for delay, if it still runs.
func (p *progress) show(seq int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if seq != p.seq || p.name == "" || p.shown {
		return
	}
	p.shown = true
	if p.tty {
		if p.bar == nil {
			p.bar = progressbar.NewOptions(p.steps, progressbar.OptionSetWriter(p.w), progressbar.OptionSetWidth(30),
				progressbar.OptionShowCount(), progressbar.OptionClearOnFinish())
			_ = p.bar.Set(p.done)
		}
		p.bar.Describe(p.prefix + ": " + p.name)
		return
	}
	fmt.Fprintf(p.w, "%s: %s: %s ...\n", p.prefix, p.name, p.what)
}

// endLocked ends the current phase: stops its timer and reports how long it
// took when its start was reported.
func (p *progress) endLocked() {
	if p.timer != nil {
		p.timer.Stop()
		p.timer = nil
	}
	if p.name == "" {
		return
	}
	p.done++
	switch {
	case p.bar != nil:
		_ = p.bar.Set(p.done)
	case p.shown:
		fmt.Fprintf(p.w, "%s: %s done in %.1f s\n", p.prefix, p.name, time.Since(p.started).Seconds())
	}
}
