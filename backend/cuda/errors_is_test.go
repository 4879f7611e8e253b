package cuda

import (
	"errors"
	"fmt"
	"testing"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// sentinels are every hal sentinel an error of this package could mean.
var sentinels = []error{hal.ErrClosed, hal.ErrFreed, hal.ErrWrongDevice, hal.ErrSize, hal.ErrInvalid,
	hal.ErrHandleExpired, hal.ErrUnavailable, hal.ErrNoKernel, hal.ErrBadPointer, hal.ErrOutOfMemory, hal.ErrDeviceLost}

// TestErrorsIs: every error type of the package matches exactly the hal
// sentinels its status means (and so gpuctx's), also when wrapped.
func TestErrorsIs(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		is   []error
	}{
		{"out of memory", &Error{Call: "cuMemAlloc_v2", Code: 2}, []error{hal.ErrOutOfMemory}},
		{"invalid value", &Error{Call: "cuMemcpyHtoDAsync_v2", Code: 1}, []error{hal.ErrInvalid}},
		{"invalid handle", &Error{Call: "cuStreamSynchronize", Code: 400}, []error{hal.ErrInvalid}},
		{"invalid device", &Error{Call: "cuDeviceGet", Code: 101}, []error{hal.ErrInvalid}},
		{"no device", &Error{Call: "cuInit", Code: 100}, []error{hal.ErrUnavailable}},
		{"stub library", &Error{Call: "cuInit", Code: 34}, []error{hal.ErrUnavailable}},
		{"kernel not found", &Error{Call: "cuModuleGetFunction", Code: 500}, []error{hal.ErrNoKernel}},
		{"not found elsewhere", &Error{Call: "cuModuleGetGlobal_v2", Code: 500}, nil},
		{"context destroyed", &Error{Call: "cuEventRecord", Code: 709}, []error{hal.ErrClosed}},
		{"illegal address", &Error{Call: "cuStreamSynchronize", Code: 700}, []error{hal.ErrDeviceLost}},
		{"launch failed", &Error{Call: "cuStreamSynchronize", Code: 719}, []error{hal.ErrDeviceLost}},
		{"not ready", &Error{Call: "cuEventQuery", Code: 600}, nil},
		{"device lost", &DeviceLostError{Device: 0, First: &Error{Call: "cuStreamSynchronize", Code: 700}}, []error{hal.ErrDeviceLost}},
		{"compilation", &CompileError{File: "k.cu", Call: "nvrtcCompileProgram", Code: 6}, []error{hal.ErrInvalid}},
		{"invalid option", &CompileError{File: "k.cu", Call: "nvrtcCompileProgram", Code: 5}, []error{hal.ErrInvalid}},
		{"nvrtc out of memory", &CompileError{File: "k.cu", Call: "nvrtcCreateProgram", Code: 1}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, err := range []error{tc.err, fmt.Errorf("cuda: test: %w", tc.err)} {
				for _, s := range sentinels {
					want := false
					for _, w := range tc.is {
						want = want || w == s
					}
					if got := errors.Is(err, s); got != want {
						t.Errorf("errors.Is(%v, %v) = %v, want %v", err, s, got, want)
					}
				}
			}
		})
	}
}
