package main

import (
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// The note Runtime.SelectionNote writes when auto selection falls back to the
// CPU backend (gpuctx.OpenBackend), with shortened diagnoses.
const cpuFallbackNote = "auto selection fell back to the CPU backend because CUDA is unavailable: " +
	"cuda: backend unavailable: dynload: cannot load CUDA driver (libcuda.so.1, libcuda.so): set GPUCTX_LIBRARY_PATH\npaths tried:\n  libcuda.so.1: no such file" +
	"\nand ROCm is unavailable: rocm: backend unavailable: dynload: cannot load HIP runtime (libamdhip64.so.6): install ROCm\npaths tried:\n  /opt/rocm/lib/libamdhip64.so.6: no such file"

func TestSkippedBackends(t *testing.T) {
	for _, c := range []struct {
		name, note string
		want       []skippedBackend
	}{
		{"cuda picked", "", nil},
		{"cpu fallback", cpuFallbackNote, []skippedBackend{
			{"cuda", "cannot load CUDA driver (libcuda.so.1, libcuda.so)", "dynload: cannot load CUDA driver (libcuda.so.1, libcuda.so): set GPUCTX_LIBRARY_PATH\npaths tried:\n  libcuda.so.1: no such file"},
			{"rocm", "cannot load HIP runtime (libamdhip64.so.6)", "dynload: cannot load HIP runtime (libamdhip64.so.6): install ROCm\npaths tried:\n  /opt/rocm/lib/libamdhip64.so.6: no such file"},
		}},
		{"rocm picked", "auto selection picked ROCm because CUDA is unavailable: cuda: backend unavailable: no CUDA device: CUDA_ERROR_NO_DEVICE", []skippedBackend{
			{"cuda", "no CUDA device", "no CUDA device: CUDA_ERROR_NO_DEVICE"},
		}},
		{"unknown shape", "something else: entirely", []skippedBackend{{"auto", "something else", "something else: entirely"}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := skippedBackends(c.note)
			if len(got) != len(c.want) {
				t.Fatalf("got %d entries %+v, want %d", len(got), got, len(c.want))
			}
			for i := range got {
				if got[i] != c.want[i] {
					t.Errorf("entry %d:\n got %+v\nwant %+v", i, got[i], c.want[i])
				}
			}
		})
	}
}

// TestInfoSkippedShort: where auto selection falls back (no GPU here), info
// says so in one short line per backend, and -v prints the whole diagnosis.
func TestInfoSkippedShort(t *testing.T) {
	t.Setenv(gpuctx.BackendEnv, "")
	rt, err := gpuctx.Open()
	if err != nil {
		t.Fatal(err)
	}
	note := rt.SelectionNote()
	_ = rt.Close()
	if note == "" {
		t.Skip("auto selection picked CUDA: no backend was passed over")
	}
	for _, c := range []struct {
		name    string
		args    []string
		maxLine int      // longest line of the output
		want    []string // in the output
	}{
		{"short", []string{"info"}, 160, []string{"  not cuda:", "(-v: why)"}},
		{"verbose", []string{"info", "-v"}, 0, []string{"  not cuda:", "paths tried:"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			code, out, errOut := execute(t, c.args...)
			if code != 0 || errOut != "" {
				t.Fatalf("exit code %d, stderr %q", code, errOut)
			}
			for _, w := range c.want {
				if !strings.Contains(out, w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			for _, l := range strings.Split(out, "\n") {
				if c.maxLine > 0 && len(l) > c.maxLine {
					t.Errorf("a line of %d characters, want at most %d: %s", len(l), c.maxLine, l)
				}
			}
		})
	}
}
