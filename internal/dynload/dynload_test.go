package dynload

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestOpenDiagnosis(t *testing.T) {
	bogusDir := t.TempDir()
	const bogusSo = "libgpuctx_bogus.so.1"
	if err := os.WriteFile(filepath.Join(bogusDir, bogusSo), []byte("this is not an ELF file\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		env      string
		spec     Spec
		wantOK   bool
		wantText []string // substrings of the error
	}{
		{
			name:     "nonexistent soname",
			spec:     Spec{Name: "test lib", Sonames: []string{"libgpuctx_nonexistent.so.99"}, Install: "nothing"},
			wantText: []string{"cannot load test lib", "libgpuctx_nonexistent.so.99:", "/usr/local/cuda/lib64/libgpuctx_nonexistent.so.99: no such file", EnvLibraryPath, "install nothing"},
		},
		{
			name:     "non-library file in GPUCTX_LIBRARY_PATH",
			env:      bogusDir,
			spec:     Spec{Name: "bogus", Sonames: []string{bogusSo}},
			wantText: []string{filepath.Join(bogusDir, bogusSo) + ": ", EnvLibraryPath},
		},
		{
			name:   "libm from the default search",
			spec:   Spec{Name: "libm", Sonames: []string{"libgpuctx_nonexistent.so.99", "libm.so.6"}},
			wantOK: true,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv(EnvLibraryPath, tc.env)
			lib, err := Open(tc.spec)
			if tc.wantOK {
				if err != nil {
					t.Fatalf("Open: %v", err)
				}
				if err := lib.Close(); err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil {
				lib.Close()
				t.Fatalf("Open(%v) succeeded, want error", tc.spec.Sonames)
			}
			var le *LoadError
			if !errors.As(err, &le) || !errors.Is(err, ErrNotFound) {
				t.Fatalf("error %T is not a *LoadError wrapping ErrNotFound: %v", err, err)
			}
			msg := err.Error()
			for _, w := range tc.wantText {
				if !strings.Contains(msg, w) {
					t.Errorf("error lacks %q:\n%s", w, msg)
				}
			}
			if tc.env != "" {
				// The directory from the env var is tried first, with the loader's
				// own message (not our "no such file").
				if le.Attempts[0].Path != filepath.Join(tc.env, tc.spec.Sonames[0]) || le.Attempts[0].Err == "no such file" || le.Attempts[0].Err == "" {
					t.Errorf("first attempt = %+v, want the env directory with a loader message", le.Attempts[0])
				}
			}
		})
	}
}

func TestOpenEmptySpec(t *testing.T) {
	if _, err := Open(Spec{Name: "x"}); err == nil || !strings.Contains(err.Error(), "Sonames is empty") {
		t.Fatalf("Open with no sonames: err = %v", err)
	}
}

func TestBind(t *testing.T) {
	lib, err := Open(Spec{Name: "libm", Sonames: []string{"libm.so.6"}})
	if err != nil {
		t.Skipf("libm.so.6 not loadable here: %v", err)
	}
	defer lib.Close()

	var cos func(float64) float64
	var sqrtf func(float32) float32
	var optionalMissing func() int32
	var required1, required2 func() int32

	tests := []struct {
		name        string
		syms        []Symbol
		wantMissing []string
		wantErr     string
	}{
		{
			name: "present and optional-missing",
			syms: []Symbol{
				{Name: "cos", Fn: &cos},
				{Name: "sqrtf", Fn: &sqrtf},
				{Name: "gpuctx_no_such_symbol", Fn: &optionalMissing, Optional: true},
			},
		},
		{
			name: "every required missing symbol is listed",
			syms: []Symbol{
				{Name: "cos", Fn: &cos},
				{Name: "gpuctx_missing_a", Fn: &required1},
				{Name: "gpuctx_missing_b", Fn: &required2},
			},
			wantMissing: []string{"gpuctx_missing_a", "gpuctx_missing_b"},
		},
		{
			name:    "Fn not a pointer to func",
			syms:    []Symbol{{Name: "cos", Fn: cos}},
			wantErr: "want a non-nil pointer to a func variable",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			optionalMissing = func() int32 { return 1 } // must be reset to nil by Bind
			err := lib.Bind(tc.syms)
			switch {
			case tc.wantMissing != nil:
				var me *MissingSymbolsError
				if !errors.As(err, &me) {
					t.Fatalf("err = %v, want *MissingSymbolsError", err)
				}
				if strings.Join(me.Missing, ",") != strings.Join(tc.wantMissing, ",") {
					t.Errorf("Missing = %v, want %v", me.Missing, tc.wantMissing)
				}
				for _, m := range tc.wantMissing {
					if !strings.Contains(err.Error(), m) {
						t.Errorf("message lacks %s: %v", m, err)
					}
				}
				if required1 != nil || required2 != nil {
					t.Error("Bind bound functions despite a missing symbol")
				}
			case tc.wantErr != "":
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
			default:
				if err != nil {
					t.Fatal(err)
				}
				if got := cos(math.Pi / 3); math.Abs(got-0.5) > 1e-12 {
					t.Errorf("cos(pi/3) through Bind = %v, want 0.5", got)
				}
				if got := sqrtf(2.25); got != 1.5 {
					t.Errorf("sqrtf(2.25) = %v, want 1.5", got)
				}
				if optionalMissing != nil {
					t.Error("missing optional symbol left a non-nil func")
				}
			}
		})
	}
}

func TestRefcount(t *testing.T) {
	spec := Spec{Name: "libm", Sonames: []string{"libm.so.6"}}
	a, err := Open(spec)
	if err != nil {
		t.Skipf("libm.so.6 not loadable here: %v", err)
	}
	b, err := Open(spec)
	if err != nil {
		t.Fatal(err)
	}
	if a != b {
		t.Fatalf("second Open returned a different *Library (%p vs %p)", a, b)
	}
	if a.Path() == "" || !strings.Contains(a.Path(), "libm") {
		t.Errorf("Path() = %q, want a path naming libm", a.Path())
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	// Still open once: Lookup works.
	if _, err := b.Lookup("cos"); err != nil {
		t.Fatalf("Lookup after first Close: %v", err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err == nil {
		t.Fatal("third Close succeeded, want an error")
	}
	var f func(float64) float64
	if err := b.Bind([]Symbol{{Name: "cos", Fn: &f}}); err == nil {
		t.Fatal("Bind after Close succeeded")
	}
}

func TestCandidatesOrder(t *testing.T) {
	t.Setenv(EnvLibraryPath, "/a:/b")
	t.Setenv("CUDA_HOME", "/cuda")
	got := candidates(Spec{Sonames: []string{"libx.so.2", "libx.so.1"}})
	want := []string{"/a/libx.so.2", "/b/libx.so.2", "/a/libx.so.1", "/b/libx.so.1", "libx.so.2", "libx.so.1", "/cuda/lib64/libx.so.2"}
	if len(got) < len(want) {
		t.Fatalf("candidates = %v", got)
	}
	for i, w := range want {
		if got[i] != w {
			t.Fatalf("candidates[%d] = %q, want %q (all: %v)", i, got[i], w, got)
		}
	}
}
