package rocm

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
	rtc := func(code int32) error { return rtcCheck(&hiprtcAPI{}, "hiprtcCompileProgram", code) }
	for _, tc := range []struct {
		name string
		err  error
		is   []error
	}{
		{"hip out of memory", &Error{Call: "hipMalloc", Code: hipErrorOutOfMemory}, []error{hal.ErrOutOfMemory}},
		{"hip invalid value", &Error{Call: "hipMemcpyAsync", Code: hipErrorInvalidValue}, []error{hal.ErrInvalid}},
		{"hip invalid handle", &Error{Call: "hipStreamSynchronize", Code: hipErrorInvalidHandle}, []error{hal.ErrInvalid}},
		{"hip bad pointer", &Error{Call: "hipFree", Code: hipErrorInvalidDevicePointer}, []error{hal.ErrBadPointer}},
		{"hip no device", &Error{Call: "hipInit", Code: hipErrorNoDevice}, []error{hal.ErrUnavailable}},
		{"hip context destroyed", &Error{Call: "hipEventRecord", Code: hipErrorContextIsDestroyed}, []error{hal.ErrClosed}},
		{"hip illegal address", &Error{Call: "hipStreamSynchronize", Code: hipErrorIllegalAddress}, []error{hal.ErrDeviceLost}},
		{"hip not ready", &Error{Call: "hipEventQuery", Code: hipErrorNotReady}, nil},
		{"rocblas invalid size", &BlasError{Call: "rocblas_gemm_ex", Status: 4}, []error{hal.ErrInvalid}},
		{"rocblas memory", &BlasError{Call: "rocblas_gemm_ex", Status: 5}, []error{hal.ErrOutOfMemory}},
		{"rocblas invalid handle", &BlasError{Call: "rocblas_gemm_ex", Status: 1}, []error{hal.ErrClosed}},
		{"rocblas not implemented", &BlasError{Call: "rocblas_gemm_ex", Status: 2}, []error{hal.ErrUnavailable}},
		{"rocblas internal", &BlasError{Call: "rocblas_gemm_ex", Status: 6}, nil},
		{"hiprtc compilation", &CompileError{File: "k.cu", Err: rtc(6)}, []error{hal.ErrInvalid}},
		{"hiprtc invalid option", &CompileError{File: "k.cu", Err: rtc(5)}, []error{hal.ErrInvalid}},
		{"hiprtc out of memory", &CompileError{File: "k.cu", Err: rtc(1)}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, err := range []error{tc.err, fmt.Errorf("rocm: test: %w", tc.err)} {
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
