package main

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// TestMoeRunCheckpointHints: the advice after a checkpoint error depends on
// its kind: a malformed model.safetensors is named with what is wrong in it
// and gets no "must hold model.safetensors" (it does hold one); a missing
// one gets that advice.
func TestMoeRunCheckpointHints(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "cpu")
	malformed := copyModel(t)
	js := `{"model.layers.1.mlp.gate.weight":{"dtype":"F32","shape":[8.5],"data_offsets":[0,32]}}`
	b := make([]byte, 8+len(js)+32)
	binary.LittleEndian.PutUint64(b, uint64(len(js)))
	copy(b[8:], js)
	if err := os.WriteFile(filepath.Join(malformed, "model.safetensors"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	missing := copyModel(t)
	if err := os.Remove(filepath.Join(missing, "model.safetensors")); err != nil {
		t.Fatal(err)
	}
	in := filepath.Join(fixture, "input.safetensors")
	const mustHold = "the directory must hold model.safetensors"
	for _, c := range []struct {
		name, model string
		layer       []string
		want        []string
		not         string
	}{
		{"malformed, layer searched", malformed, nil, []string{`shape[0] is 8.5`, "re-download"}, mustHold},
		{"malformed, layer given", malformed, []string{"--layer", "1"}, []string{`shape[0] is 8.5`, "re-download"}, mustHold},
		{"missing", missing, nil, []string{mustHold}, "re-download"},
		{"missing, layer given", missing, []string{"--layer", "1"}, []string{mustHold}, "re-download"},
	} {
		t.Run(c.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "y.safetensors")
			args := append([]string{"moe", "run", "--model", c.model, "--input", in, "--output", out}, c.layer...)
			code, stdout, stderr := execute(t, args...)
			wantOneLineFailure(t, code, stdout, stderr, c.want...)
			if strings.Contains(stderr, c.not) {
				t.Errorf("stderr %q contains the wrong advice %q", stderr, c.not)
			}
		})
	}
}
