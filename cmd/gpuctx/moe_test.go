package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/backend/cpu"
	"github.com/gpuctx/gpuctx/bench"
	"github.com/gpuctx/gpuctx/moe"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// fixture is a transformers-recorded MoE layer (moe/testdata): config.json,
// model.safetensors, input.safetensors with x, expected.safetensors with y.
const fixture = "../../moe/testdata/deepseek_v2_greedy"

// readTensor returns tensor name of a safetensors file as float32 with its shape.
func readTensor(t *testing.T, path, name string) ([]float32, []int) {
	t.Helper()
	f, err := safetensors.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	v, info, err := f.Float32(name)
	if err != nil {
		t.Fatal(err)
	}
	return v, info.Shape
}

func TestMoeRunFixture(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	want, wantShape := readTensor(t, filepath.Join(fixture, "expected.safetensors"), "y")
	cases := []struct {
		name string
		args []string
		json bool
	}{
		{"f32 single", []string{"--dtype", "f32", "--mode", "single"}, false},
		{"f32 dual", []string{"--dtype", "f32", "--mode", "dual"}, false},
		{"f32 auto json", []string{"--layer", "1", "--json"}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			out := filepath.Join(dir, "y.safetensors")
			in := filepath.Join(fixture, "input.safetensors")
			before, err := os.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			args := append([]string{"moe", "run", "--model", fixture, "--input", in, "--output", out}, c.args...)
			code, stdout, stderr := execute(t, args...)
			if code != 0 || stderr != "" {
				t.Fatalf("exit code %d, stderr %q", code, stderr)
			}
			got, shape := readTensor(t, out, "y")
			if len(shape) != 2 || shape[0] != wantShape[0] || shape[1] != wantShape[1] {
				t.Fatalf("y has shape %v, want %v", shape, wantShape)
			}
			var maxRef, maxDiff float64
			for i := range want {
				maxRef = max(maxRef, math.Abs(float64(want[i])))
				maxDiff = max(maxDiff, math.Abs(float64(got[i])-float64(want[i])))
			}
			if rel := maxDiff / maxRef; !(rel <= 1e-5) {
				t.Errorf("max|y-expected|/max|expected| = %.3g > 1e-5", rel)
			}
			if after, _ := os.ReadFile(in); !bytes.Equal(before, after) {
				t.Error("the input file changed")
			}
			if ents, _ := os.ReadDir(dir); len(ents) != 1 {
				t.Errorf("output directory holds %d entries, want only y.safetensors (no temporary files)", len(ents))
			}
			if c.json {
				var rep moeRunReport
				dec := json.NewDecoder(strings.NewReader(stdout))
				dec.DisallowUnknownFields()
				if err := dec.Decode(&rep); err != nil {
					t.Fatalf("--json output does not parse: %v\n%s", err, stdout)
				}
				if rep.Tokens != wantShape[0] || rep.Hidden != wantShape[1] || rep.Layer != 1 || rep.Backend != "cpu" || rep.Tensor != "x" {
					t.Errorf("report %+v does not describe the run", rep)
				}
			} else {
				for _, w := range []string{"deepseek_v2 layer 1", "(cpu)", "x[7×64]", "forward", "wrote y[7×64]"} {
					if !strings.Contains(stdout, w) {
						t.Errorf("summary lacks %q:\n%s", w, stdout)
					}
				}
			}
		})
	}
}

// writeX writes a safetensors file holding x (F32) of the given shape.
func writeX(t *testing.T, path string, shape []int) {
	t.Helper()
	n := 1
	for _, d := range shape {
		n *= d
	}
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(math.Sin(float64(i)))
	}
	ts, err := safetensors.FromFloat32("x", safetensors.F32, shape, x)
	if err != nil {
		t.Fatal(err)
	}
	if err := safetensors.Write(path, []safetensors.Tensor{ts}, nil); err != nil {
		t.Fatal(err)
	}
}

func TestMoeRunFailures(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	dir := t.TempDir()
	in := filepath.Join(fixture, "input.safetensors")
	out := filepath.Join(dir, "y.safetensors")
	// A model whose layer 0 is dense (first_k_dense_replace = 1).
	dense := filepath.Join(dir, "dense")
	if err := os.Mkdir(dense, 0o755); err != nil {
		t.Fatal(err)
	}
	cj, err := os.ReadFile(filepath.Join(fixture, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	cj = bytes.Replace(cj, []byte(`"first_k_dense_replace": 0`), []byte(`"first_k_dense_replace": 1`), 1)
	if err := os.WriteFile(filepath.Join(dense, "config.json"), cj, 0o644); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.Mkdir(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	wrongH := filepath.Join(dir, "wrongh.safetensors")
	writeX(t, wrongH, []int{2, 32})
	rank3 := filepath.Join(dir, "rank3.safetensors")
	writeX(t, rank3, []int{1, 2, 64})
	inCopy := filepath.Join(dir, "x.safetensors")
	writeX(t, inCopy, []int{2, 64})
	inBytes, _ := os.ReadFile(inCopy)

	run := func(extra ...string) []string {
		return append([]string{"moe", "run", "--model", fixture, "--input", in, "--output", out}, extra...)
	}
	cases := []struct {
		name string
		args []string
		want []string
	}{
		{"missing model dir", []string{"moe", "run", "--model", filepath.Join(dir, "nope"), "--input", in, "--output", out},
			[]string{"model directory", "nope", "config.json"}},
		{"no model flag", []string{"moe", "run", "--input", in, "--output", out}, []string{"--model is required"}},
		{"no config.json", []string{"moe", "run", "--model", empty, "--input", in, "--output", out}, []string{"reading the model config", "config.json"}},
		{"dense layer", []string{"moe", "run", "--model", dense, "--layer", "0", "--input", in, "--output", out},
			[]string{"--layer 0", "dense MLP layer", "first_k_dense_replace", "the first is 1"}},
		{"layer out of range", run("--layer", "9"), []string{"--layer 9", "out of range"}},
		{"wrong H", []string{"moe", "run", "--model", fixture, "--input", wrongH, "--output", out},
			[]string{"shape [2 32]", "hidden_size is 64", "[tokens, 64]"}},
		{"rank 3", []string{"moe", "run", "--model", fixture, "--input", rank3, "--output", out},
			[]string{"shape [1 2 64]", "rank 3", "must be [tokens, hidden]", "[tokens, 64]"}},
		{"output is input", []string{"moe", "run", "--model", fixture, "--input", inCopy, "--output", inCopy},
			[]string{"is the --input file", "never overwritten"}},
		{"output is input by another path", []string{"moe", "run", "--model", fixture, "--input", inCopy,
			"--output", filepath.Join(dir, ".", "dense", "..", "x.safetensors")}, []string{"is the --input file"}},
		{"unknown mode", run("--mode", "triple"), []string{`--mode "triple" is not a mode`, "single, dual, auto or fused"}},
		{"bad dtype", run("--dtype", "f16"), []string{`--dtype "f16"`, "f32, bf16 or fp8"}},
		{"missing input", run("--input", filepath.Join(dir, "none.safetensors")), []string{"reading --input", "none.safetensors"}},
		{"output dir missing", run("--output", filepath.Join(dir, "no", "y.safetensors")), []string{"directory does not exist"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := execute(t, c.args...)
			wantOneLineFailure(t, code, stdout, stderr, c.want...)
			if _, err := os.Stat(out); err == nil {
				t.Errorf("%s was written by a failing run", out)
			}
		})
	}
	if after, _ := os.ReadFile(inCopy); !bytes.Equal(after, inBytes) {
		t.Error("a failing run changed the input file")
	}
}

func TestMoeBenchCPU(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	dir := t.TempDir()
	md, png := filepath.Join(dir, "moe.md"), filepath.Join(dir, "moe.png")
	code, stdout, stderr := execute(t, "moe", "bench", "--tokens", "1,4", "--iters", "2", "--warmup", "0", "--out", md, "--plot", png)
	if code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, stderr)
	}
	onlyProgress(t, "moe bench", stderr)
	for _, w := range []string{"scaled down", "backend cpu", "gpuctx moe bench --tokens 1,4 --iters 2 --warmup 0",
		"| tokens |", "single µs", "dual µs", "shared µs", "routed µs", "\n| 1 ", "\n| 4 ",
		"the overlap and % of floor columns are left out"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("output lacks %q:\n%s", w, stdout)
		}
	}
	// CPU times give meaningless overlap and % of floor: not in the table
	if strings.Contains(stdout, "| overlap") || strings.Contains(stdout, "| % of floor") {
		t.Errorf("the CPU table has the overlap or %% of floor column:\n%s", stdout)
	}
	if strings.Contains(stdout, "\n| 8 ") {
		t.Errorf("output has a row for 8 tokens, which --tokens did not ask for:\n%s", stdout)
	}
	if b, err := os.ReadFile(md); err != nil || string(b) != stdout {
		t.Errorf("--out file differs from the printed table (err %v)", err)
	}
	if b, err := os.ReadFile(png); err != nil || !bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")) {
		t.Errorf("--plot did not write a PNG (err %v)", err)
	}

	code, stdout, stderr = execute(t, "moe", "bench", "--tokens", "1,4", "--iters", "2", "--warmup", "0", "--mode", "single,dual,fused", "--json")
	if code != 0 || !strings.Contains(stderr, "moe bench: [") {
		t.Fatalf("--json: exit code %d, no progress lines on stderr %q", code, stderr)
	}
	onlyProgress(t, "moe bench", stderr)
	var rep moeBenchReport
	dec := json.NewDecoder(strings.NewReader(stdout))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rep); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, stdout)
	}
	if rep.Backend != "cpu" || !rep.ScaledDown || rep.Iters != 2 || len(rep.Rows) != 2 || rep.CopyBW <= 0 || rep.GemmRate <= 0 {
		t.Fatalf("report does not describe the run: %+v", rep)
	}
	for i, row := range rep.Rows {
		if row.Tokens != []int{1, 4}[i] || row.MedianUS["single"] <= 0 || row.MedianUS["dual"] <= 0 || row.RoutedUS <= 0 ||
			row.SharedUS == nil || *row.SharedUS <= 0 || row.Overlap == nil || row.WeightBytes <= 0 || !(row.FloorUS > 0) || row.PctOfFloor <= 0 {
			t.Errorf("row %d incomplete: %+v", i, row)
		}
		if fu, ok := row.MedianUS["fused"]; !ok || row.FusedOverlap == nil || row.SharedUS == nil ||
			math.Abs(*row.FusedOverlap-(row.MedianUS["single"]-fu)/min(*row.SharedUS, row.RoutedUS)) > 1e-9 {
			t.Errorf("row %d: fused overlap %v, want (single - fused) / min(shared, routed) from %+v", i, row.FusedOverlap, row)
		}
		if want := batchFLOPs(&moe.Config{HiddenSize: cpuHidden, NumExperts: cpuExperts, TopK: rep.Shape.TopK, Intermediate: cpuIntermediate,
			SharedIntermediate: rep.Shape.Shared}, row.Tokens); row.FLOPs != want {
			t.Errorf("row %d: FLOPs %g, want %g", i, row.FLOPs, want)
		}
	}
}

func TestMoeBenchFailures(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	cases := []struct {
		name string
		args []string
		want []string
	}{
		{"unknown preset", []string{"--preset", "gpt-5"}, []string{`--preset "gpt-5" is not a preset`, "deepseek-v2-lite"}},
		{"preset and model", []string{"--preset", "qwen3-30b-a3b", "--model", fixture}, []string{"both set"}},
		{"layer without model", []string{"--layer", "1"}, []string{"--layer needs --model"}},
		{"bad tokens", []string{"--tokens", "1,x"}, []string{`"x" is not a token count`}},
		{"zero tokens", []string{"--tokens", "0"}, []string{`"0" is not a token count`}},
		{"repeated tokens", []string{"--tokens", "1,1"}, []string{"lists 1 twice"}},
		{"unknown mode", []string{"--mode", "single,both"}, []string{`--mode "both" is not a mode`}},
		{"bad iters", []string{"--iters", "0"}, []string{"--iters 0"}},
		{"deepseek-v3 full size on CPU", []string{"--preset", "deepseek-v3", "--full-size"}, []string{"deepseek-v3", "host memory", "drop --full-size"}},
		{"unknown tile", []string{"--tile", "m1n1"}, []string{`--tile "m1n1" is not a tile`, fmt.Sprintf("one of the %d tags", len(moe.TileTags())), "m16n64k64w1x4s6, "}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := execute(t, append([]string{"moe", "bench"}, c.args...)...)
			wantOneLineFailure(t, code, stdout, stderr, c.want...)
			if strings.Contains(stderr, "fewer experts") {
				t.Errorf("advice about experts for a flag error: %s", stderr)
			}
		})
	}
}

func TestScaleDownKeepsEveryPresetValid(t *testing.T) {
	for _, name := range moe.PresetNames() {
		t.Run(name, func(t *testing.T) {
			full, err := moe.Preset(name)
			if err != nil {
				t.Fatal(err)
			}
			s, err := scaleDown(full)
			if err != nil {
				t.Fatal(err)
			}
			if s.HiddenSize != cpuHidden || s.NumExperts != cpuExperts || s.Intermediate != cpuIntermediate {
				t.Errorf("scaled shape H=%d E=%d I=%d", s.HiddenSize, s.NumExperts, s.Intermediate)
			}
			if (full.SharedIntermediate > 0) != (s.SharedIntermediate > 0) || s.Family != full.Family || s.TopKMethod != full.TopKMethod {
				t.Errorf("scaling changed the layer's kind: %+v -> %+v", full, s)
			}
			if full.HiddenSize == cpuHidden {
				t.Errorf("preset already has the scaled hidden size; the test proves nothing")
			}
		})
	}
}

func TestBatchFLOPs(t *testing.T) {
	c := moe.DeepseekV2Lite()
	// 2*T*H*E + 2*T*K*3*H*I + 2*T*3*H*Is for T=1: 262144 + 103809024 + 34603008.
	if got, want := batchFLOPs(c, 1), 262144.0+103809024+34603008; got != want {
		t.Errorf("batchFLOPs(T=1) = %g, want %g", got, want)
	}
	if got, want := batchFLOPs(c, 4096), 4096*batchFLOPs(c, 1); got != want {
		t.Errorf("batchFLOPs(T=4096) = %g, want %g (linear in T)", got, want)
	}
}

func TestWriteTable(t *testing.T) {
	var b strings.Builder
	writeTable(&b, [][]string{{"tokens", "µs"}, {"1", "12.5"}, {"1024", "3"}})
	want := "| tokens |   µs |\n" +
		"| ------ | ---: |\n" +
		"| 1      | 12.5 |\n" +
		"| 1024   |    3 |\n"
	if b.String() != want {
		t.Errorf("got\n%s\nwant\n%s", b.String(), want)
	}
}

func TestParseTokens(t *testing.T) {
	cases := []struct {
		in   string
		want []int
		ok   bool
	}{
		{"1,8,64", []int{1, 8, 64}, true},
		{" 4 , 2", []int{4, 2}, true},
		{"", nil, false},
		{"1,,2", nil, false},
		{"-1", nil, false},
		{"2097152", nil, false},
	}
	for _, c := range cases {
		got, err := parseTokens(c.in)
		if (err == nil) != c.ok || (c.ok && !slices.Equal(got, c.want)) {
			t.Errorf("parseTokens(%q) = %v, %v; want %v, ok=%v", c.in, got, err, c.want, c.ok)
		}
	}
}

func TestMoeBenchModel(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	code, stdout, stderr := execute(t, "moe", "bench", "--model", fixture, "--tokens", "2", "--iters", "1", "--warmup", "0", "--dtype", "f32", "--json")
	if code != 0 || strings.Contains(stderr, "warning") {
		t.Fatalf("exit code %d, stderr %q (a layer smaller than the CPU shape is no full-size warning)", code, stderr)
	}
	onlyProgress(t, "moe bench", stderr)
	var rep moeBenchReport
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, stdout)
	}
	// The fixture checkpoint holds layer 1 only: the bench must pick it, keep
	// its real shape (no scaling) and time one row.
	if rep.Model != fixture || rep.Layer == nil || *rep.Layer != 1 || rep.ScaledDown || rep.Shape.Hidden != 64 ||
		rep.DType != "f32" || len(rep.Rows) != 1 || rep.Rows[0].Tokens != 2 || rep.Rows[0].MedianUS["dual"] <= 0 {
		t.Errorf("report does not describe the run: %+v", rep)
	}
}

func TestMoeBenchCommandLine(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	code, stdout, stderr := execute(t, "moe", "bench", "--tokens", "1", "--iters", "1", "--warmup", "0", "--small-batch", "-1", "--no-graphs",
		"--mode", "single", "--seed", "3", "--json")
	if code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, stderr)
	}
	var rep moeBenchReport
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatal(err)
	}
	want := "GPUCTX_BACKEND=cpu gpuctx moe bench --tokens 1 --iters 1 --warmup 0 --small-batch -1 --no-graphs --mode single --seed 3 --json"
	if rep.Command != want {
		t.Errorf("command\n %q, want\n %q", rep.Command, want)
	}
	if got := shellQuote("a b'c"); got != `'a b'\''c'` {
		t.Errorf("shellQuote: %s", got)
	}
}

func TestMoeBenchPlotOneToken(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	png := filepath.Join(t.TempDir(), "one.png")
	// one token count: a single point per line on a log axis (panicked before)
	code, _, stderr := execute(t, "moe", "bench", "--tokens", "1", "--iters", "1", "--warmup", "0", "--plot", png)
	if code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, stderr)
	}
	if b, err := os.ReadFile(png); err != nil || !bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")) {
		t.Errorf("--plot did not write a PNG (err %v)", err)
	}
}

func TestPlotRangesAndTicks(t *testing.T) {
	lo, hi, ok := logRange([]float64{8, 0, 8, math.NaN()}, plotPadX)
	if !ok || !(lo < 8 && hi > 8 && lo > 0) {
		t.Errorf("one value: range [%v, %v] %v, want a padded positive range", lo, hi, ok)
	}
	if _, _, ok := logRange([]float64{0, -1}, 2); ok {
		t.Error("no positive value gave a range")
	}
	lo, hi, _ = logRange([]float64{1, 64, 4096}, plotPadX)
	var labels []string
	for _, tk := range tokenTicks([]int{1, 64, 4096}).Ticks(lo, hi) {
		labels = append(labels, tk.Label)
	}
	if strings.Join(labels, ",") != "1,64,4096" {
		t.Errorf("token ticks %v, want the token counts run", labels)
	}
	for _, r := range [][2]float64{{30, 40}, {3, 50000}, {0.5, 2}} {
		n := 0
		for _, tk := range latencyTicks(r[0], r[1]) {
			if tk.Label != "" {
				n++
			}
			if tk.Value < r[0] || tk.Value > r[1] {
				t.Errorf("range %v: tick %v outside", r, tk.Value)
			}
		}
		if n < 2 {
			t.Errorf("range %v: %d labelled ticks", r, n)
		}
	}
	rep := &moeBenchReport{Backend: "cpu", Preset: "x"}
	if !strings.Contains(plotTitle(rep), "say nothing about a GPU") {
		t.Errorf("CPU plot title %q", plotTitle(rep))
	}
	rep.Backend = "cuda"
	if strings.Contains(plotTitle(rep), "GPU") {
		t.Errorf("CUDA plot title %q", plotTitle(rep))
	}
}

func TestFloorModel(t *testing.T) {
	// 1 MB at 1e12 B/s = 1 µs; 1e9 FLOP at 1e15 FLOP/s = 1 µs
	f := bench.NewFloor(2e6, 1e9, 1e12, 1e15)
	if f.BytesUS != 2 || f.ComputeUS != 1 || f.US != 2 || f.Bound != "bytes" {
		t.Errorf("bytes-bound floor %+v", f)
	}
	f = bench.NewFloor(1e6, 3e9, 1e12, 1e15)
	if f.US != 3 || f.Bound != "compute" {
		t.Errorf("compute-bound floor %+v", f)
	}
	if m := bench.Median([]float64{3, 1, 2, 10}); m != 3 {
		t.Errorf("median %v, want the upper median 3", m)
	}
}

// TestMoeRunLoadLayer: moe run builds the layer with moe.LoadLayer, and its
// output equals bit for bit that of moe.NewLayer on moe.LoadWeights, from an
// F32 and a BF16 checkpoint into f32 and bf16 layers, with the shared expert
// on the side stream and fused into the routed kernels; --autotune changes no
// bit.
func TestMoeRunLoadLayer(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	cfg, err := moe.LoadConfig(fixture)
	if err != nil {
		t.Fatal(err)
	}
	w, err := moe.LoadWeights(fixture, cfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	bf16 := t.TempDir()
	ts, err := moe.LayerTensors(cfg, w, 1, moe.Fused, safetensors.BF16)
	if err != nil {
		t.Fatal(err)
	}
	if err := safetensors.Write(filepath.Join(bf16, "model.safetensors"), ts, nil); err != nil {
		t.Fatal(err)
	}
	cj, err := os.ReadFile(filepath.Join(fixture, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bf16, "config.json"), cj, 0o644); err != nil {
		t.Fatal(err)
	}
	in := filepath.Join(t.TempDir(), "x.safetensors")
	const T = 40
	writeX(t, in, []int{T, cfg.HiddenSize})
	x, _ := readTensor(t, in, "x")
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	for _, model := range []struct{ name, dir string }{{"f32 file", fixture}, {"bf16 file", bf16}} {
		wm, err := moe.LoadWeights(model.dir, cfg, 1)
		if err != nil {
			t.Fatal(err)
		}
		for _, dtype := range []string{"f32", "bf16"} {
			for _, mode := range []string{"dual", "fused"} {
				t.Run(model.name+"/"+dtype+"/"+mode, func(t *testing.T) {
					dt, _ := parseLayerDType(dtype)
					m, _ := moe.ParseMode(mode)
					l, err := moe.NewLayer(dev, cfg, wm, moe.LayerOptions{DType: dt, Mode: m, AutoThreshold: moe.DefaultAutoThreshold})
					if err != nil {
						t.Fatal(err)
					}
					want, err := l.Forward(x, T)
					_ = l.Close()
					if err != nil {
						t.Fatal(err)
					}
					for _, extra := range [][]string{nil, {"--autotune"}} {
						out := filepath.Join(t.TempDir(), "y.safetensors")
						args := append([]string{"moe", "run", "--model", model.dir, "--input", in, "--output", out, "--dtype", dtype, "--mode", mode}, extra...)
						code, _, stderr := execute(t, args...)
						if code != 0 || stderr != "" {
							t.Fatalf("%v: exit code %d, stderr %q", args, code, stderr)
						}
						got, _ := readTensor(t, out, "y")
						if len(got) != len(want) {
							t.Fatalf("%v: %d values, want %d", extra, len(got), len(want))
						}
						for i := range want {
							if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
								t.Fatalf("%v: y[%d] = %v, NewLayer on LoadWeights gives %v", extra, i, got[i], want[i])
							}
						}
					}
				})
			}
		}
	}
}

// TestForwardNote: moe run -v says how the fused tiles were picked where
// there are fused tiles to pick (CUDA, bf16).
func TestForwardNote(t *testing.T) {
	for _, c := range []struct {
		backend  string
		dt       gpuctx.DType
		autotune bool
		cached   bool
		want     string
	}{
		{"cuda", gpuctx.BF16, false, false, "rule of thumb (--autotune times them)"},
		{"cuda", gpuctx.BF16, true, false, "includes timing the fused GEMM tiles (--autotune)"},
		{"cuda", gpuctx.BF16, true, true, "fused GEMM tiles from the tuning cache (--autotune; GPUCTX_KERNEL_CACHE=off times them)"},
		{"cuda", gpuctx.F32, false, false, "kernel lookups excluded"},
		{"cpu", gpuctx.BF16, false, false, "kernel lookups excluded"},
	} {
		got := forwardNote(c.backend, c.dt, c.autotune, c.cached)
		if !strings.HasSuffix(got, c.want) {
			t.Errorf("forwardNote(%s, %v, %v, %v) = %q, want it to end %q", c.backend, c.dt, c.autotune, c.cached, got, c.want)
		}
	}
}

// TestMoeRunLoadErrors: a checkpoint that does not match config.json is a
// loading error naming the tensor; a device too small for the layer is a
// device error.
func TestMoeRunLoadErrors(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	cfg, err := moe.LoadConfig(fixture)
	if err != nil {
		t.Fatal(err)
	}
	w, err := moe.LoadWeights(fixture, cfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	ts, err := moe.LayerTensors(cfg, w, 1, moe.PerExpert, safetensors.BF16)
	if err != nil {
		t.Fatal(err)
	}
	missing := copyModel(t)
	var keep []safetensors.Tensor
	for _, x := range ts {
		if x.Name != "model.layers.1.mlp.experts.3.up_proj.weight" {
			keep = append(keep, x)
		}
	}
	if err := safetensors.Write(filepath.Join(missing, "model.safetensors"), keep, nil); err != nil {
		t.Fatal(err)
	}
	in := filepath.Join(fixture, "input.safetensors")
	for _, c := range []struct {
		name, model, memory string
		want                []string
	}{
		{"missing tensor", missing, "", []string{"loading the weights of layer 1", "experts.3.up_proj.weight (shape [32 64] expected) is missing", "check that the checkpoint matches config.json"}},
		{"device too small", fixture, "40000", []string{"building the MoE layer on the device", "out of device memory", "try --dtype bf16"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.memory != "" {
				t.Setenv(cpu.MemoryLimitEnv, c.memory)
			}
			out := filepath.Join(t.TempDir(), "y.safetensors")
			code, stdout, stderr := execute(t, "moe", "run", "--model", c.model, "--input", in, "--output", out, "--layer", "1")
			wantOneLineFailure(t, code, stdout, stderr, c.want...)
			if _, err := os.Stat(out); err == nil {
				t.Errorf("%s was written by a failing run", out)
			}
		})
	}
}
