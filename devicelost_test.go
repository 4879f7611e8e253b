package gpuctx_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx"
)

// TestDeviceLostAfterKernelFault: a kernel that faults (the CPU backend's
// equivalent of CUDA_ERROR_ILLEGAL_ADDRESS: it writes past its buffer) loses
// the device, as a sticky CUDA error does. Every later call, on any stream,
// returns an error matching gpuctx.ErrDeviceLost that names the first failure,
// and nothing hangs. Close still works.
func TestDeviceLostAfterKernelFault(t *testing.T) {
	d := cpuDevice(t)
	s, other := newStream(t, d), newStream(t, d)
	y, err := d.Alloc(16)
	if err != nil {
		t.Fatal(err)
	}
	fill, err := d.Kernel("gpuctx_fill_f32")
	if err != nil {
		t.Fatal(err)
	}
	one := gpuctx.Dim3{X: 1, Y: 1, Z: 1}
	if err := s.Launch(fill, one, one, 0, y, float32(1), int64(1000)); err != nil {
		t.Fatal(err)
	}
	done := make(chan []error, 1)
	go func() {
		var errs []error
		errs = append(errs, s.Synchronize(), other.Launch(fill, one, one, 0, y, float32(1), int64(4)), other.Synchronize(), d.Synchronize())
		_, err := d.Alloc(16)
		errs = append(errs, err)
		_, err = d.NewStream(gpuctx.StreamOptions{})
		errs = append(errs, err)
		errs = append(errs, y.CopyFromHost(make([]byte, 16)))
		ctx, err := d.NewContext(gpuctx.ContextOptions{Stream: other})
		if err == nil {
			errs = append(errs, ctx.Blas(func(h gpuctx.Blas) error {
				return h.Gemm(gpuctx.Gemm{M: 1, N: 1, K: 1, A: y, B: y, C: y, AB: gpuctx.F32, CType: gpuctx.F32})
			}))
			_ = ctx.Close()
		}
		done <- errs
	}()
	select {
	case errs := <-done:
		for i, err := range errs {
			if !errors.Is(err, gpuctx.ErrDeviceLost) || !strings.Contains(err.Error(), "gpuctx_fill_f32") {
				t.Errorf("call %d after the fault: got %v; want gpuctx.ErrDeviceLost naming the first failure (gpuctx_fill_f32)", i, err)
			}
		}
	case <-time.After(30 * time.Second):
		t.Fatal("calls after the fault hang")
	}
}
