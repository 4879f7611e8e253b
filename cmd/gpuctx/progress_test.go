package main

import (
	"bytes"
	"io"
	"os"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe"
)

// TestMain keeps progress lines out of the output the tests compare: on a
// busy machine a test's phase may outlast progressDelay.
// TestProgressLines sets its own delay.
func TestMain(m *testing.M) {
	progressDelay = time.Hour
	os.Exit(m.Run())
}

// TestProgressLines: off a terminal, a phase that runs past the delay gets a
// line when the delay passes and one when it ends; a shorter one gets none.
// Time is synctest's, so nothing really sleeps.
func TestProgressLines(t *testing.T) {
	type step struct {
		name string
		runs time.Duration
	}
	for _, c := range []struct {
		name  string
		steps []step
		want  string
	}{
		{"all short", []step{{"parse", 10 * time.Millisecond}, {"load", 400 * time.Millisecond}}, ""},
		{"one long", []step{{"parse", 10 * time.Millisecond}, {"load", 2 * time.Second}, {"forward", time.Millisecond}},
			"moe run: load: what load does ...\nmoe run: load done in 2.0 s\n"},
		{"long at the end", []step{{"write", 3 * time.Second}},
			"moe run: write: what write does ...\nmoe run: write done in 3.0 s\n"},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var buf bytes.Buffer
				var w io.Writer = &buf
				p := newProgress(&w, "moe run", len(c.steps))
				p.delay = 500 * time.Millisecond
				for _, s := range c.steps {
					p.phase(s.name, "what "+s.name+" does")
					time.Sleep(s.runs)
					synctest.Wait()
				}
				p.finish()
				if got := buf.String(); got != c.want {
					t.Errorf("progress wrote\n%q\nwant\n%q", got, c.want)
				}
			})
		})
	}
}

// TestPhasesProgressLabel: moe run's load phase, which includes the kernel
// lookups (NVRTC on a first run) that -v later charges to compile, is
// reported by progress as "load and compile", so its "done in" matches -v's
// load plus compile.
func TestPhasesProgressLabel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var buf bytes.Buffer
		var w io.Writer = &buf
		ph := phases{prog: newProgress(&w, "moe run", 2)}
		ph.prog.delay = 500 * time.Millisecond
		ph.begin("load")
		time.Sleep(2 * time.Second)
		synctest.Wait()
		ph.end()
		want := "moe run: load and compile: weights read and uploaded, kernels looked up (compiled by NVRTC on a machine's first run) ...\n" +
			"moe run: load and compile done in 2.0 s\n"
		if got := buf.String(); got != want {
			t.Errorf("progress wrote\n%q\nwant\n%q", got, want)
		}
		if _, ok := ph.d["load"]; !ok {
			t.Errorf("phases charged %v, want the time under load", ph.d)
		}
	})
}

// TestNilProgress: a nil reporter (no progress wanted) is safe to use.
func TestNilProgress(t *testing.T) {
	var p *progress
	p.phase("load", "")
	p.finish()
	var ph phases
	ph.begin("load")
	ph.end()
}

// TestWarnFullSize: moe run warns, in one line on stderr, when a full-size
// layer runs on the CPU backend, and says nothing for a CPU-sized one.
func TestWarnFullSize(t *testing.T) {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	full, err := moe.Preset("deepseek-v2-lite")
	if err != nil {
		t.Fatal(err)
	}
	small, err := scaleDown(full)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		cfg  *moe.Config
		dt   gpuctx.DType
		want string // "" for no warning
	}{
		{"full size bf16", full, gpuctx.BF16, "gpuctx: warning: moe run: a full-size layer (1.1 GiB in bf16, H=2048, E=64) on the CPU backend"},
		{"full size f32", full, gpuctx.F32, "(2.1 GiB in f32"},
		{"scaled down", small, gpuctx.F32, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			var buf bytes.Buffer
			a := &app{out: io.Discard, errOut: &buf}
			a.warnFullSize(dev, c.cfg, c.dt)
			got := buf.String()
			switch {
			case c.want == "" && got != "":
				t.Errorf("warned for a CPU-sized layer: %q", got)
			case c.want != "" && (!strings.Contains(got, c.want) || strings.Count(got, "\n") != 1):
				t.Errorf("warning %q, want one line containing %q", got, c.want)
			}
		})
	}
}
