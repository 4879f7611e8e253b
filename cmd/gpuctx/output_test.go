package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe"
)

// copyModel copies the fixture checkpoint (config.json, model.safetensors) to a
// new directory, so that a run that wrongly overwrites it harms only the copy.
func copyModel(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"config.json", "model.safetensors"} {
		b, err := os.ReadFile(filepath.Join(fixture, n))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, n), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// executeWithin runs the CLI and fails the test if it has not returned in 10 s.
func executeWithin(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	type res struct {
		code           int
		stdout, stderr string
	}
	done := make(chan res, 1)
	go func() {
		var out, errb bytes.Buffer
		code := run(args, &out, &errb)
		done <- res{code, out.String(), errb.String()}
	}()
	select {
	case r := <-done:
		return r.code, r.stdout, r.stderr
	case <-time.After(10 * time.Second):
		t.Fatalf("gpuctx %s still running after 10s", strings.Join(args, " "))
		return 0, "", ""
	}
}

// TestMoeRunRefusesToOverwriteItsInputs: --output may not be any file the run
// reads (config.json, model.safetensors, the input), by any path: the same
// name, a symbolic link or a hard link.
func TestMoeRunRefusesToOverwriteItsInputs(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	model := copyModel(t)
	in := filepath.Join(fixture, "input.safetensors")
	other := t.TempDir()
	hard := filepath.Join(other, "hard.safetensors")
	if err := os.Link(filepath.Join(model, "model.safetensors"), hard); err != nil {
		t.Fatal(err)
	}
	soft := filepath.Join(other, "soft.json")
	if err := os.Symlink(filepath.Join(model, "config.json"), soft); err != nil {
		t.Fatal(err)
	}
	weights, _ := os.ReadFile(filepath.Join(model, "model.safetensors"))
	config, _ := os.ReadFile(filepath.Join(model, "config.json"))
	for _, c := range []struct{ name, out, want string }{
		{"model.safetensors", filepath.Join(model, "model.safetensors"), "model.safetensors"},
		{"config.json", filepath.Join(model, "config.json"), "config.json"},
		{"hard link", hard, "model.safetensors"},
		{"symbolic link", soft, "config.json"},
	} {
		t.Run(c.name, func(t *testing.T) {
			code, stdout, stderr := executeWithin(t, "moe", "run", "--model", model, "--input", in, "--output", c.out)
			wantOneLineFailure(t, code, stdout, stderr, "--output", "which this run reads", c.want)
		})
	}
	if b, _ := os.ReadFile(filepath.Join(model, "model.safetensors")); !bytes.Equal(b, weights) {
		t.Error("model.safetensors was changed")
	}
	if b, _ := os.ReadFile(filepath.Join(model, "config.json")); !bytes.Equal(b, config) {
		t.Error("config.json was changed")
	}
	if l, err := os.Lstat(soft); err != nil || l.Mode()&os.ModeSymlink == 0 {
		t.Error("the symbolic link was replaced")
	}
}

func TestMoeRunInputChecks(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	dir := t.TempDir()
	out := filepath.Join(dir, "y.safetensors")
	fifo := filepath.Join(dir, "x.fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty.safetensors")
	writeX(t, empty, []int{0, 64})
	in := filepath.Join(fixture, "input.safetensors")
	for _, c := range []struct {
		name string
		args []string
		want []string
	}{
		{"input is a FIFO", []string{"--input", fifo}, []string{"--input", "named pipe", "regular file"}},
		{"input is a directory", []string{"--input", dir}, []string{"--input", "is a directory"}},
		{"no tokens", []string{"--input", empty}, []string{"has no tokens"}},
		{"negative layer", []string{"--input", in, "--layer", "-5"}, []string{"--layer -5", ">= 0"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			args := append([]string{"moe", "run", "--model", fixture, "--output", out}, c.args...)
			code, stdout, stderr := executeWithin(t, args...)
			wantOneLineFailure(t, code, stdout, stderr, c.want...)
			if strings.Contains(stderr, "no such device") || strings.Contains(stderr, "hidden_size is 64") {
				t.Errorf("unclear message: %s", stderr)
			}
		})
	}
	if _, err := os.Stat(out); err == nil {
		t.Error("a failing run wrote the output")
	}
}

// TestMoeRunHugeConfigs: layer fields far beyond the checkpoint end at once.
func TestMoeRunHugeConfigs(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	in := filepath.Join(fixture, "input.safetensors")
	for _, c := range []struct{ name, from, to, want string }{
		{"layers 1e12", `"num_hidden_layers": 2`, `"num_hidden_layers": 1000000000000`, "num_hidden_layers = 1000000000000"},
		{"first_k_dense 1e15", `"first_k_dense_replace": 0`, `"first_k_dense_replace": 1000000000000000`, "first_k_dense_replace = 1000000000000000"},
		{"experts 1e9", `"n_routed_experts": 8`, `"n_routed_experts": 1000000000`, "n_routed_experts = 1000000000"},
		{"many layers, no MoE tensors there", `"first_k_dense_replace": 0`, `"first_k_dense_replace": 2`, "no MoE layer"},
	} {
		t.Run(c.name, func(t *testing.T) {
			model := copyModel(t)
			p := filepath.Join(model, "config.json")
			cj, _ := os.ReadFile(p)
			if !bytes.Contains(cj, []byte(c.from)) {
				t.Fatalf("fixture config.json lacks %s", c.from)
			}
			cj = bytes.Replace(cj, []byte(c.from), []byte(c.to), 1)
			cj = bytes.Replace(cj, []byte(`"num_hidden_layers": 2,`), []byte(`"num_hidden_layers": 16000,`), 1)
			if err := os.WriteFile(p, cj, 0o644); err != nil {
				t.Fatal(err)
			}
			code, stdout, stderr := executeWithin(t, "moe", "run", "--model", model, "--input", in, "--output", filepath.Join(t.TempDir(), "y.safetensors"))
			wantOneLineFailure(t, code, stdout, stderr, c.want)
		})
	}
}

// TestReadInputTokenLimit: T beyond the kernels' 32-bit limit is refused from
// the header, before the input is decoded.
func TestReadInputTokenLimit(t *testing.T) {
	cfg, err := moe.LoadConfig(fixture)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Intermediate = 1 << 17 // T*2I > 2^31 from T = 8193
	p := filepath.Join(t.TempDir(), "x.safetensors")
	writeX(t, p, []int{8193, cfg.HiddenSize})
	_, _, _, err = readInput(p, cfg)
	if err == nil || !strings.Contains(err.Error(), "32-bit") {
		t.Fatalf("err = %v", err)
	}
}

// TestMoeRunOutputTargets: an existing output keeps its mode; a FIFO output is
// refused before any work; a character device is written through.
func TestMoeRunOutputTargets(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	in := filepath.Join(fixture, "input.safetensors")
	dir := t.TempDir()
	out := filepath.Join(dir, "y.safetensors")
	if err := os.WriteFile(out, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, _, stderr := executeWithin(t, "moe", "run", "--model", fixture, "--input", in, "--output", out); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if st, _ := os.Stat(out); st.Mode().Perm() != 0o600 {
		t.Errorf("output mode %v, want 0600 kept", st.Mode().Perm())
	}
	fifo := filepath.Join(dir, "y.fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := executeWithin(t, "moe", "run", "--model", fixture, "--input", in, "--output", fifo)
	wantOneLineFailure(t, code, stdout, stderr, "--output", "named pipe")
	if st, _ := os.Lstat(fifo); st.Mode()&os.ModeNamedPipe == 0 {
		t.Error("the FIFO was replaced")
	}
	null := filepath.Join(dir, "null")
	if err := syscall.Mknod(null, syscall.S_IFCHR|0o666, 1<<8|3); err != nil {
		t.Log("mknod (needs root):", err)
		return
	}
	if code, _, stderr := executeWithin(t, "moe", "run", "--model", fixture, "--input", in, "--output", null); code != 0 {
		t.Fatalf("--output to a null device: exit %d: %s", code, stderr)
	}
	if st, _ := os.Lstat(null); st.Mode()&os.ModeCharDevice == 0 {
		t.Error("the device node was replaced by a regular file")
	}
}
