package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/internal/dynload"
)

// execute runs the CLI in-process and returns its exit code and output.
func execute(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(args, &out, &errb)
	return code, out.String(), errb.String()
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
		{name: "unknown backend flag", args: []string{"info", "--backend", "tpu"},
			want: []string{`--backend "tpu" is not a backend`, "auto, cuda, rocm or cpu"}},
		{name: "unknown backend env", env: "tpu", args: []string{"info"},
			want: []string{`"tpu"`, "GPUCTX_BACKEND", "auto, cuda, rocm or cpu"}},
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

// TestCudaUnavailable covers both ways CUDA can be missing: no libcuda (the
// loader's report: what to do first, then the paths tried, one per line) and
// a libcuda without a device (one line). Either way the first line names the
// backend and the message says what to do.
func TestCudaUnavailable(t *testing.T) {
	_, openErr := gpuctx.OpenBackend("cuda")
	if openErr == nil {
		t.Skip("CUDA is available here, so this failure cannot happen")
	}
	var le *dynload.LoadError
	libraryMissing := errors.As(openErr, &le)
	for _, c := range []struct {
		name, env string
		args      []string
		want      string
	}{
		{"flag", "", []string{"info", "--backend", "cuda"}, `opening backend "cuda" (from --backend)`},
		{"env", "cuda", []string{"info"}, `opening backend "cuda" (from GPUCTX_BACKEND)`},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(gpuctx.BackendEnv, c.env)
			code, out, errOut := execute(t, c.args...)
			if libraryMissing {
				wantLoadErrorText(t, code, out, errOut, c.want)
				return
			}
			// libcuda loads but finds no device (or is unusable): one line.
			wantOneLineFailure(t, code, out, errOut, c.want, "--backend cpu")
			if strings.Count(errOut, "unavailable") > 1 {
				t.Errorf("stderr repeats \"unavailable\": %q", errOut)
			}
		})
	}
}

// wantLoadErrorText checks the layout of a library that failed to load:
// exit code 1, nothing on stdout, "gpuctx: <head>: cannot load ..." first,
// then "what to do:" with the command's advice and GPUCTX_LIBRARY_PATH, then
// "paths tried:" with one path per line, none repeated.
func wantLoadErrorText(t *testing.T, code int, stdout, stderr, head string) {
	t.Helper()
	if code != 1 || stdout != "" {
		t.Errorf("exit code %d, stdout %q; want 1 and nothing", code, stdout)
	}
	lines := strings.Split(strings.TrimSuffix(stderr, "\n"), "\n")
	if !strings.HasPrefix(lines[0], "gpuctx: "+head+": cannot load ") || strings.Contains(stderr, "gpuctx: gpuctx:") {
		t.Errorf("first line %q, want \"gpuctx: %s: cannot load ...\"", lines[0], head)
	}
	todo, tried := slices.Index(lines, "what to do:"), slices.Index(lines, "paths tried:")
	if todo != 1 || tried < todo+2 || tried == len(lines)-1 {
		t.Fatalf("want \"what to do:\" on line 2, then advice, then \"paths tried:\" and paths:\n%s", stderr)
	}
	advice := strings.Join(lines[todo:tried], "\n")
	for _, w := range []string{"--backend cpu", dynload.EnvLibraryPath, "install"} {
		if !strings.Contains(advice, w) {
			t.Errorf("advice lacks %q:\n%s", w, advice)
		}
	}
	seen := map[string]bool{}
	for _, l := range lines[tried+1:] {
		path, msg, ok := strings.Cut(strings.TrimSpace(l), ": ")
		if !strings.HasPrefix(l, "  ") || !ok || msg == "" {
			t.Errorf("paths tried: line %q is not \"  PATH: WHY\"", l)
		}
		if seen[path] || strings.HasPrefix(msg, path+":") {
			t.Errorf("paths tried: %q repeated", path)
		}
		seen[path] = true
	}
}

// TestLoadErrorText lays out a synthetic missing-libcuda error as the CLI
// wraps it, so that the layout is tested on machines that have libcuda too.
func TestLoadErrorText(t *testing.T) {
	le := &dynload.LoadError{
		Spec: dynload.Spec{Name: "CUDA driver", Sonames: []string{"libcuda.so.1", "libcuda.so"}, Install: "the NVIDIA driver"},
		Attempts: []dynload.Attempt{
			{Path: "libcuda.so.1", Err: "libcuda.so.1: cannot open shared object file: No such file or directory"},
			{Path: "libcuda.so", Err: "libcuda.so: cannot open shared object file: No such file or directory"},
			{Path: "/usr/local/cuda/lib64/libcuda.so.1", Err: "no such file"},
		},
	}
	err := fail(`opening backend "cuda" (from --backend)`, "to run without a GPU, use --backend cpu",
		fmt.Errorf("gpuctx: backend cuda was requested but is unavailable: %w", fmt.Errorf("cuda: %w: %w", gpuctx.ErrUnavailable, le)))
	text := errorLine(err)
	wantLoadErrorText(t, 1, "", text+"\n", `opening backend "cuda" (from --backend)`)
	want := `gpuctx: opening backend "cuda" (from --backend): cannot load CUDA driver (libcuda.so.1, libcuda.so)
what to do:
  - to run without a GPU, use --backend cpu
  - set GPUCTX_LIBRARY_PATH to the directory (or colon-separated directories) holding libcuda.so.1, or install the NVIDIA driver
paths tried:
  libcuda.so.1: cannot open shared object file: No such file or directory
  libcuda.so: cannot open shared object file: No such file or directory
  /usr/local/cuda/lib64/libcuda.so.1: no such file`
	if text != want {
		t.Errorf("got:\n%s\nwant:\n%s", text, want)
	}
}

// TestMoeAlonePrintsHelp: the usage line offers "gpuctx moe", so it succeeds.
func TestMoeAlonePrintsHelp(t *testing.T) {
	code, out, errOut := execute(t, "moe")
	if code != 0 || errOut != "" || !strings.Contains(out, "Usage:") || !strings.Contains(out, "bench") {
		t.Errorf("gpuctx moe: exit code %d, stderr %q, stdout:\n%s", code, errOut, out)
	}
}

// TestHelpDefaultsOnce: cobra appends "(default X)" to every flag with a
// non-zero default, so no help string may state its own default as well.
func TestHelpDefaultsOnce(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"info", "--help"}, {"gemm", "--help"}, {"moe", "--help"}, {"moe", "run", "--help"}, {"moe", "bench", "--help"}} {
		code, out, _ := execute(t, args...)
		if code != 0 {
			t.Fatalf("%v: exit code %d", args, code)
		}
		for _, l := range strings.Split(out, "\n") {
			if strings.HasPrefix(strings.TrimSpace(l), "-") && strings.Count(l, "default") > 1 {
				t.Errorf("%v: flag help states its default twice: %q", args, l)
			}
		}
	}
}

func TestVersion(t *testing.T) {
	bi := &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "abc1234def5678900000"}, {Key: "vcs.time", Value: "2026-12-01T10:00:00Z"}, {Key: "vcs.modified", Value: "true"}}}
	for _, c := range []struct {
		bi       *debug.BuildInfo
		override string
		want     string
	}{
		{bi, "", "devel (commit abc1234def56, 2026-12-01, modified)"},
		{bi, "0123456", "devel (commit 0123456)"},
		{&debug.BuildInfo{Main: debug.Module{Version: "v1.2.3"}}, "", "v1.2.3 (no commit recorded"},
		{&debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-20261201143537-64955ab386c7+dirty"}, Settings: bi.Settings}, "", "devel (commit abc1234def56, 2026-12-01, modified)"},
	} {
		if got := formatVersion(c.bi, c.override); !strings.HasPrefix(got, c.want) {
			t.Errorf("formatVersion(%v, %q) = %q, want %q", c.bi.Settings, c.override, got, c.want)
		}
	}
	// Without a commit the message says how to get one, go run first (it is
	// how the README runs the CLI), not only -buildvcs.
	if got := formatVersion(&debug.BuildInfo{}, ""); !strings.Contains(got, "go run records one only with -buildvcs=true") {
		t.Errorf("formatVersion without a commit = %q, want the go run advice", got)
	}
	code, out, _ := execute(t, "--version")
	if code != 0 || !strings.HasPrefix(out, "gpuctx ") || strings.Contains(out, "(devel)") {
		t.Errorf("--version: exit code %d, output %q", code, out)
	}
}

// TestGemmCPUScaledDown: a GPU-sized gemm on the CPU backend shrinks, says so
// and prints a rate with significant digits.
func TestGemmCPUScaledDown(t *testing.T) {
	code, out, errOut := execute(t, "gemm", "--backend", "cpu", "--dtype", "bf16", "--m", "8192", "--n", "8192", "--k", "8192", "--streams", "2")
	if code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, errOut)
	}
	for _, w := range []string{"C[512×512]", "note: CPU backend: scaled down (shape 8192×8192×8192 to 512×512×512", "--full-size", "GFLOP/s", "stream 1:"} {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q:\n%s", w, out)
		}
	}
	if strings.Contains(out, " 0.00 ") {
		t.Errorf("a rate printed as 0.00:\n%s", out)
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
