package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// traceJSON is the part of a --trace file the tests read.
type traceJSON struct {
	TraceEvents []struct {
		Name string  `json:"name"`
		Ph   string  `json:"ph"`
		Tid  uint64  `json:"tid"`
		ID   int     `json:"id"`
		Ts   float64 `json:"ts"`
	} `json:"traceEvents"`
	OtherData map[string]string `json:"otherData"`
}

// readTrace parses a --trace file and returns it with its span names.
func readTrace(t *testing.T, path string) (traceJSON, []string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var tr traceJSON
	if err := json.Unmarshal(b, &tr); err != nil {
		t.Fatalf("--trace %s is not JSON: %v", path, err)
	}
	var names []string
	for _, e := range tr.TraceEvents {
		if e.Ph == "X" {
			names = append(names, e.Name)
		}
	}
	return tr, names
}

// moe run -v prints every phase to stderr (and nothing to stdout's summary
// changes); --trace writes a trace of the forward with both streams.
func TestMoeRunVerboseAndTrace(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	dir := t.TempDir()
	out, trace := filepath.Join(dir, "y.safetensors"), filepath.Join(dir, "moe.json")
	in := filepath.Join(fixture, "input.safetensors")
	args := []string{"moe", "run", "--model", fixture, "--input", in, "--output", out,
		"--dtype", "f32", "--mode", "dual", "-v", "--trace", trace}
	code, stdout, stderr := execute(t, args...)
	if code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, stderr)
	}
	if !strings.Contains(stdout, "wrote y[7×64]") {
		t.Errorf("summary changed:\n%s", stdout)
	}
	for _, w := range []string{"wall time (cpu backend)", "\n  open ", "\n  parse ", "\n  load ", "\n  compile ",
		"kernel lookups (CPU backend", "\n  forward ", "\n  trace ", "\n  write ", "\n  total ", "trace: ", "ui.perfetto.dev"} {
		if !strings.Contains(stderr, w) {
			t.Errorf("-v output lacks %q:\n%s", w, stderr)
		}
	}
	// The summary's load time is the breakdown's load phase, to the digit.
	sum := regexp.MustCompile(`load ([0-9.]+) ms \(weights to the device\)`).FindStringSubmatch(stdout)
	phase := regexp.MustCompile(`\n  load +([0-9.]+) ms  weights`).FindStringSubmatch(stderr)
	if sum == nil || phase == nil || sum[1] != phase[1] {
		t.Errorf("summary's load %q differs from -v's load phase %q:\n%s\n%s", sum, phase, stdout, stderr)
	}
	tr, names := readTrace(t, trace)
	joined := strings.Join(names, ",")
	for _, w := range []string{"moe forward T=7 dual", "gpuctx_moe_route", "gpuctx_moe_combine", "cpu gemm", "stream wait"} {
		if !strings.Contains(joined, w) {
			t.Errorf("trace spans lack %q: %s", w, joined)
		}
	}
	tracks := map[uint64]bool{}
	for _, e := range tr.TraceEvents {
		if e.Ph == "X" {
			tracks[e.Tid] = true
		}
	}
	if len(tracks) != 2 {
		t.Errorf("spans on %d stream tracks, want 2 (main and side)", len(tracks))
	}
	// The trace records the whole command line, as typed, and the backend
	// variable that chose the backend.
	if want := "GPUCTX_BACKEND=cpu gpuctx " + strings.Join(args, " "); tr.OtherData["command"] != want || !strings.HasPrefix(tr.OtherData["graphs"], "off") {
		t.Errorf("metadata %v", tr.OtherData)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 2 {
		t.Errorf("directory holds %d entries, want y.safetensors and moe.json", len(ents))
	}

	// --trace may not replace a file the run reads.
	code, _, stderr = execute(t, "moe", "run", "--model", fixture, "--input", in, "--output", out, "--trace", in)
	if code == 0 || !strings.Contains(stderr, "--trace") {
		t.Errorf("--trace naming the input: exit %d, stderr %q", code, stderr)
	}
}

// moe bench --trace and gemm --trace write traces of one forward per token
// count and mode, and of one round of GEMMs on each stream.
func TestBenchTrace(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	dir := t.TempDir()
	mt := filepath.Join(dir, "bench.json")
	code, _, stderr := execute(t, "moe", "bench", "--tokens", "1,4", "--iters", "1", "--warmup", "0", "--mode", "single,dual", "--trace", mt)
	if code != 0 {
		t.Fatalf("moe bench: exit code %d, stderr %q", code, stderr)
	}
	tr, names := readTrace(t, mt)
	joined := strings.Join(names, ",")
	for _, w := range []string{"moe forward T=1 single", "moe forward T=1 dual", "moe forward T=4 dual", "gpuctx_moe_"} {
		if !strings.Contains(joined, w) {
			t.Errorf("moe bench trace lacks %q: %s", w, joined)
		}
	}
	if strings.Contains(joined, "graph (") {
		t.Errorf("moe bench --trace replayed a graph: %s", joined)
	}
	if !strings.Contains(tr.OtherData["graphs"], "NoGraphs") {
		t.Errorf("moe bench trace metadata %v does not say graphs are off", tr.OtherData)
	}

	gt := filepath.Join(dir, "gemm.json")
	code, _, stderr = execute(t, "gemm", "--m", "64", "--n", "64", "--k", "64", "--streams", "2", "--iters", "2", "--repeats", "1", "--warmup", "1", "--trace", gt)
	if code != 0 {
		t.Fatalf("gemm: exit code %d, stderr %q", code, stderr)
	}
	tr, names = readTrace(t, gt)
	tids := map[uint64]bool{}
	n := 0
	for _, e := range tr.TraceEvents {
		if e.Ph == "X" && e.Name == "cpu gemm" {
			tids[e.Tid] = true
			n++
		}
	}
	if n != 4 || len(tids) != 2 {
		t.Errorf("gemm trace: %d GEMM spans on %d tracks, want 4 on 2: %v", n, len(tids), names)
	}
}

func TestQuoteArg(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"--model", "--model"},
		{"/tmp/a-b_c.d/x,y:z=1", "/tmp/a-b_c.d/x,y:z=1"},
		{"", "''"},
		{"a b", "'a b'"},
		{"it's", `'it'\''s'`},
		{"$HOME", "'$HOME'"},
	} {
		t.Run(c.in, func(t *testing.T) {
			if got := quoteArg(c.in); got != c.want {
				t.Errorf("quoteArg(%q) = %s, want %s", c.in, got, c.want)
			}
		})
	}
}
