package gpuctx_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/backend/cpu"
	"github.com/gpuctx/gpuctx/backend/cuda"
	"github.com/gpuctx/gpuctx/backend/cuda/cublas"
	"github.com/gpuctx/gpuctx/internal/blas"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// TestOneSentinelPerCondition: the libraries' exported sentinels are
// gpuctx's, and the backends' error types match gpuctx's sentinels, so
// errors.Is matches across layers.
func TestOneSentinelPerCondition(t *testing.T) {
	for _, tc := range []struct {
		name      string
		got, want error
	}{
		{"hal.ErrClosed", hal.ErrClosed, gpuctx.ErrClosed},
		{"blas.ErrInvalid", blas.ErrInvalid, gpuctx.ErrInvalid},
	} {
		if tc.got != tc.want {
			t.Errorf("%s is not gpuctx's sentinel", tc.name)
		}
	}
	for _, tc := range []struct {
		name string
		err  error
		want error
	}{
		{"cuda.ErrOutOfMemory", cuda.ErrOutOfMemory, gpuctx.ErrOutOfMemory},
		{"cuda.ErrIllegalAddr", cuda.ErrIllegalAddr, gpuctx.ErrDeviceLost},
		{"cublas.DriverError out of memory", &cublas.DriverError{Call: "cuMemAlloc_v2", Result: 2}, gpuctx.ErrOutOfMemory},
		{"cublas.StatusError alloc failed", &cublas.StatusError{Call: "cublasGemmEx", Status: 3}, gpuctx.ErrOutOfMemory},
	} {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s does not match %v", tc.name, tc.want)
		}
	}
}

// TestBackendClosedErrors: a closed object of the CPU backend, reached below
// gpuctx, reports ErrClosed, in the one message shape.
func TestBackendClosedErrors(t *testing.T) {
	be, err := cpu.Open()
	if err != nil {
		t.Fatal(err)
	}
	d, err := be.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.NewStream(hal.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Destroy(); err != nil {
		t.Fatal(err)
	}
	err = s.Synchronize()
	if !errors.Is(err, gpuctx.ErrClosed) {
		t.Fatalf("Synchronize on a destroyed stream: %v, want ErrClosed", err)
	}
	if msg := err.Error(); !strings.HasPrefix(msg, "cpu: ") || !strings.HasSuffix(msg, ": "+gpuctx.ErrClosed.Error()) {
		t.Fatalf("message %q is not shaped \"<pkg>: <Op>: <what>: <cause>\"", msg)
	}
	_ = be.Close()
}

// TestMessageShape: gpuctx's own errors end with their cause.
func TestMessageShape(t *testing.T) {
	_, err := gpuctx.OpenBackend("nope")
	if !errors.Is(err, gpuctx.ErrInvalid) {
		t.Fatalf("unknown backend: %v, want ErrInvalid", err)
	}
	if msg := err.Error(); !strings.HasPrefix(msg, "gpuctx: ") || !strings.HasSuffix(msg, ": "+gpuctx.ErrInvalid.Error()) {
		t.Fatalf("message %q is not shaped \"gpuctx: <Op>: <what>: <cause>\"", msg)
	}
}
