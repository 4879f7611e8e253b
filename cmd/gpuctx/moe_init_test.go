package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/moe"
	"github.com/gpuctx/gpuctx/moe/safetensors"
)

// TestMoeInit writes a small checkpoint of every preset and checks what moe
// run needs of it: config.json parses to the preset's (scaled) layer with
// its first MoE layer last, the layer's weights load, x has the shape asked
// for, and moe run on the CPU backend reads it all and writes y.
func TestMoeInit(t *testing.T) {
	for _, preset := range moe.PresetNames() {
		t.Run(preset, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ckpt") // created by moe init
			code, out, errOut := execute(t, "moe", "init", "--preset", preset, "--small", "--tokens", "3", "--dir", dir)
			if code != 0 {
				t.Fatalf("moe init: exit %d\n%s%s", code, out, errOut)
			}
			if !strings.Contains(out, "next: gpuctx moe run --model "+dir) || !strings.Contains(errOut, "moe init: done") {
				t.Errorf("output does not say what was written and what to run next:\n%s%s", out, errOut)
			}
			full, err := moe.Preset(preset)
			if err != nil {
				t.Fatal(err)
			}
			want, err := scaleDown(full)
			if err != nil {
				t.Fatal(err)
			}
			layer, err := want.FirstMoELayer()
			if err != nil {
				t.Fatal(err)
			}
			want.NumHiddenLayers = layer + 1
			got, err := moe.LoadConfig(dir)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("config.json describes\n %+v\nwant\n %+v", *got, *want)
			}
			if _, err := moe.LoadWeights(dir, got, layer); err != nil {
				t.Errorf("LoadWeights(layer %d): %v", layer, err)
			}
			f, err := safetensors.Open(filepath.Join(dir, "input.safetensors"))
			if err != nil {
				t.Fatal(err)
			}
			info, ok := f.Info("x")
			f.Close()
			if !ok || !reflect.DeepEqual(info.Shape, []int{3, want.HiddenSize}) || info.DType != safetensors.BF16 {
				t.Errorf("input x: %+v (present %v), want BF16 [3 %d]", info, ok, want.HiddenSize)
			}
			y := filepath.Join(t.TempDir(), "y.safetensors")
			code, out, errOut = execute(t, "moe", "run", "--backend", "cpu", "--model", dir, "--input", filepath.Join(dir, "input.safetensors"), "--output", y)
			if code != 0 {
				t.Fatalf("moe run on the new checkpoint: exit %d\n%s%s", code, out, errOut)
			}
			if _, err := os.Stat(y); err != nil {
				t.Errorf("moe run wrote no output: %v", err)
			}
		})
	}
}

// TestMoeInitJSON checks --json: one object naming the files, and no progress
// lines.
func TestMoeInitJSON(t *testing.T) {
	dir := t.TempDir()
	code, out, errOut := execute(t, "--json", "moe", "init", "--small", "--dtype", "f32", "--dir", dir)
	if code != 0 || errOut != "" {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
	var r moeInitReport
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("stdout is not one JSON object: %v\n%s", err, out)
	}
	if r.Dir != dir || r.Preset != "deepseek-v2-lite" || r.DType != "F32" || r.Tokens != 64 || r.Layer != 1 || len(r.Files) != 3 || r.Bytes <= 0 {
		t.Errorf("report %+v", r)
	}
}

// TestMoeInitFailures checks that bad flags and a directory that already
// holds a checkpoint fail with one line saying what to do, and that nothing
// in the directory is changed.
func TestMoeInitFailures(t *testing.T) {
	taken := t.TempDir()
	cj := filepath.Join(taken, "config.json")
	if err := os.WriteFile(cj, []byte("{\"mine\": true}"), 0o600); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want []string
		once string // appears exactly once in the message
	}{
		{"no dir", []string{"moe", "init"}, []string{"--dir is required"}, ""},
		{"existing checkpoint", []string{"moe", "init", "--small", "--dir", taken}, []string{"already holds config.json", "never overwrites"}, ""},
		{"dir is a file", []string{"moe", "init", "--small", "--dir", file}, []string{"is not a directory"}, ""},
		{"bad dtype", []string{"moe", "init", "--dtype", "f16", "--dir", t.TempDir()}, []string{`--dtype "f16"`, "bf16, f32 or fp8"}, ""},
		{"bad preset", []string{"moe", "init", "--preset", "gpt-5", "--dir", t.TempDir()}, []string{`--preset "gpt-5" is not a preset`, "deepseek-v2-lite"}, "deepseek-v2-lite"},
		{"bad tokens", []string{"moe", "init", "--tokens", "0", "--dir", t.TempDir()}, []string{"--tokens 0"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := execute(t, tc.args...)
			wantOneLineFailure(t, code, out, errOut, tc.want...)
			if tc.once != "" && strings.Count(errOut, tc.once) != 1 {
				t.Errorf("%q appears %d times, want once: %s", tc.once, strings.Count(errOut, tc.once), errOut)
			}
		})
	}
	if b, err := os.ReadFile(cj); err != nil || string(b) != "{\"mine\": true}" {
		t.Errorf("the existing config.json changed: %q, %v", b, err)
	}
	if ents, _ := os.ReadDir(taken); len(ents) != 1 {
		t.Errorf("moe init wrote into a directory it refused: %d entries", len(ents))
	}
}
