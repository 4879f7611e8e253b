package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/gpuctx/gpuctx"
)

// execute runs the CLI in-process and returns its exit code and output.
func execute(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(args, &out, &errb)
	return code, out.String(), errb.String()
}

// cudaAvailable reports whether the CUDA backend opens here.
func cudaAvailable() bool {
	rt, err := gpuctx.OpenBackend("cuda")
	if err != nil {
		return false
	}
	rt.Close()
	return true
}

// wantOneLineFailure checks the CLI's failure contract: exit code 1, nothing on
// stdout (no usage dump), exactly one line on stderr starting "gpuctx: " that
// contains every string of want.
func wantOneLineFailure(t *testing.T, code int, stdout, stderr string, want ...string) {
	t.Helper()
	if code != 1 {
		t.Errorf("exit code %d, want 1", code)
	}
	if stdout != "" {
		t.Errorf("stdout not empty on failure:\n%s", stdout)
	}
	if !strings.HasPrefix(stderr, "gpuctx: ") || !strings.HasSuffix(stderr, "\n") || strings.Count(stderr, "\n") != 1 {
		t.Errorf("stderr is not one line starting with \"gpuctx: \":\n%q", stderr)
	}
	if strings.Contains(stderr, "gpuctx: gpuctx:") || strings.Contains(stderr, "Usage:") {
		t.Errorf("stderr repeats the prefix or dumps usage: %q", stderr)
	}
	for _, w := range want {
		if !strings.Contains(stderr, w) {
			t.Errorf("stderr %q does not contain %q", stderr, w)
		}
	}
}

func TestInfoText(t *testing.T) {
	cases := []struct {
		name string
		env  string // GPUCTX_BACKEND
		args []string
	}{
		{"flag", "", []string{"info", "--backend", "cpu"}},
		{"flag before command", "", []string{"--backend=cpu", "info"}},
		{"env", "cpu", []string{"info"}},
		{"flag overrides env", "no-such-backend", []string{"info", "--backend", "cpu"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(gpuctx.BackendEnv, c.env)
			code, out, errOut := execute(t, c.args...)
			if code != 0 || errOut != "" {
				t.Fatalf("exit code %d, stderr %q", code, errOut)
			}
			for _, want := range []string{"backend:", "cpu", "device 0:", "CPU (", "SMs:", "memory:", "MiB total",
				"check: kernel gpuctx_empty (compile and launch): ok", "check: BLAS handle (Context.Blas): ok", "libraries:", "gonum"} {
				if !strings.Contains(out, want) {
					t.Errorf("output lacks %q:\n%s", want, out)
				}
			}
			if strings.Contains(out, "FAILED") {
				t.Errorf("a check failed on the CPU backend:\n%s", out)
			}
		})
	}
}

func TestInfoJSON(t *testing.T) {
	code, out, errOut := execute(t, "--backend", "cpu", "info", "--json")
	if code != 0 || errOut != "" {
		t.Fatalf("exit code %d, stderr %q", code, errOut)
	}
	var rep infoReport
	dec := json.NewDecoder(strings.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rep); err != nil {
		t.Fatalf("output is not the JSON report: %v\n%s", err, out)
	}
	if rep.Backend != "cpu" || len(rep.Devices) != 1 {
		t.Fatalf("backend %q with %d devices, want cpu with 1", rep.Backend, len(rep.Devices))
	}
	d := rep.Devices[0]
	if d.Name == "" || d.SMs <= 0 || d.TotalMemoryBytes == 0 || d.Error != "" {
		t.Errorf("device report incomplete: %+v", d)
	}
	if len(d.Checks) != 3 {
		t.Errorf("got %d checks, want 3: %+v", len(d.Checks), d.Checks)
	}
	for _, c := range d.Checks {
		if !c.OK || c.Error != "" {
			t.Errorf("check %q failed: %s", c.Name, c.Error)
		}
	}
	if len(rep.Libraries) == 0 || rep.Libraries[0].Name != "gonum" || rep.Libraries[0].Version == "" {
		t.Errorf("libraries = %+v, want gonum with a version", rep.Libraries)
	}
}

func TestFailures(t *testing.T) {
	cases := []struct {
		name string
		env  string
		args []string
		want []string
		skip func() bool
	}{
		{name: "cuda unavailable", args: []string{"info", "--backend", "cuda"},
			want: []string{`opening backend "cuda"`, "libcuda", "GPUCTX_LIBRARY_PATH", "--backend cpu"}, skip: cudaAvailable},
		{name: "cuda unavailable from env", env: "cuda", args: []string{"info"},
			want: []string{"from GPUCTX_BACKEND", "GPUCTX_LIBRARY_PATH"}, skip: cudaAvailable},
		{name: "unknown backend flag", args: []string{"info", "--backend", "tpu"},
			want: []string{`--backend "tpu" is not a backend`, "auto, cuda or cpu"}},
		{name: "unknown backend env", env: "tpu", args: []string{"info"},
			want: []string{`"tpu"`, "GPUCTX_BACKEND", "auto, cuda or cpu"}},
		{name: "unknown command", args: []string{"infox"}, want: []string{`unknown command "infox"`, "--help"}},
		{name: "unknown flag", args: []string{"info", "--frobnicate"}, want: []string{"unknown flag: --frobnicate", "--help"}},
		{name: "extra argument", args: []string{"info", "extra"}, want: []string{`"extra"`}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.skip != nil && c.skip() {
				t.Skip("CUDA is available here, so this failure cannot happen")
			}
			t.Setenv(gpuctx.BackendEnv, c.env)
			code, out, errOut := execute(t, c.args...)
			wantOneLineFailure(t, code, out, errOut, c.want...)
		})
	}
}

func TestPanicIsOneLine(t *testing.T) {
	saved := commands
	t.Cleanup(func() { commands = saved })
	register(func(*app) *cobra.Command {
		return &cobra.Command{Use: "boom", RunE: func(*cobra.Command, []string) error { panic("kaboom") }}
	})
	code, out, errOut := execute(t, "boom")
	wantOneLineFailure(t, code, out, errOut, "internal error", "kaboom")
}

func TestHelp(t *testing.T) {
	code, out, errOut := execute(t, "--help")
	if code != 0 || errOut != "" {
		t.Fatalf("exit code %d, stderr %q", code, errOut)
	}
	for _, want := range []string{"info", "--backend", "--json", gpuctx.BackendEnv, "GPUCTX_LIBRARY_PATH",
		gpuctx.WorkspaceEnv, gpuctx.MaxHandlesEnv} {
		if !strings.Contains(out, want) {
			t.Errorf("help lacks %q", want)
		}
	}
}

func TestOneLine(t *testing.T) {
	cases := []struct{ in, want string }{
		{"plain", "plain"},
		{"gpuctx: a: gpuctx: b", "a: b"},
		{"tried:\n  x: no\n  y: no\nset Z\n", "tried: x: no; y: no; set Z"},
		{"Did you mean this?\n\tinfo\n", "Did you mean this? info"},
	}
	for _, c := range cases {
		if got := oneLine(c.in); got != c.want {
			t.Errorf("oneLine(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}
