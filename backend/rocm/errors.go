package rocm

import (
	"errors"
	"fmt"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// hipError_t values used here (hip_runtime_api.h).
const (
	hipSuccess                   = 0
	hipErrorInvalidValue         = 1
	hipErrorOutOfMemory          = 2
	hipErrorNotInitialized       = 3
	hipErrorInvalidDevicePointer = 17
	hipErrorNoDevice             = 100
	hipErrorInvalidDevice        = 101
	hipErrorInvalidHandle        = 400
	hipErrorNotReady             = 600
	hipErrorIllegalAddress       = 700
	hipErrorContextIsDestroyed   = 709
	hipErrorLaunchFailure        = 719
	hipErrorNotSupported         = 801
)

// Error is a failed HIP call: the call, the hipError_t and its name.
type Error struct {
	Call string
	Code int32
	Name string // hipGetErrorName, e.g. "hipErrorOutOfMemory"
}

// Error reads "hipMalloc: hipErrorOutOfMemory (2)".
func (e *Error) Error() string { return fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Code) }

// Is maps HIP errors to the hal sentinels.
func (e *Error) Is(target error) bool {
	switch target {
	case hal.ErrOutOfMemory:
		return e.Code == hipErrorOutOfMemory
	case hal.ErrInvalid:
		return e.Code == hipErrorInvalidValue || e.Code == hipErrorInvalidHandle
	case hal.ErrBadPointer:
		return e.Code == hipErrorInvalidDevicePointer
	case hal.ErrUnavailable:
		return e.Code == hipErrorNoDevice || e.Code == hipErrorNotInitialized || e.Code == hipErrorNotSupported
	case hal.ErrDeviceLost:
		return e.Code == hipErrorIllegalAddress || e.Code == hipErrorLaunchFailure
	case hal.ErrClosed:
		return e.Code == hipErrorContextIsDestroyed
	}
	return false
}

// check turns a hipError_t into an error naming call, or nil.
func check(a *hipAPI, call string, r int32) error {
	if r == hipSuccess {
		return nil
	}
	name := ""
	if a != nil && a.getErrorName != nil {
		name = a.getErrorName(r)
	}
	if name == "" {
		name = "hipError?"
	}
	return &Error{Call: call, Code: r, Name: name}
}

// rocblas_status values (rocblas-types.h).
var rocblasStatusNames = map[int32]string{
	0:  "rocblas_status_success",
	1:  "rocblas_status_invalid_handle",
	2:  "rocblas_status_not_implemented",
	3:  "rocblas_status_invalid_pointer",
	4:  "rocblas_status_invalid_size",
	5:  "rocblas_status_memory_error",
	6:  "rocblas_status_internal_error",
	7:  "rocblas_status_perf_degraded",
	8:  "rocblas_status_size_query_mismatch",
	9:  "rocblas_status_size_increased",
	10: "rocblas_status_size_unchanged",
	11: "rocblas_status_invalid_value",
	12: "rocblas_status_continue",
	13: "rocblas_status_check_numerics_fail",
	14: "rocblas_status_excluded_from_build",
	15: "rocblas_status_arch_mismatch",
}

// BlasError is a failed rocBLAS call.
type BlasError struct {
	Call   string
	Status int32
	Name   string
}

// Error reads "rocblas_gemm_ex: rocblas_status_invalid_size (4)".
func (e *BlasError) Error() string { return fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Status) }

// Is maps rocBLAS statuses to the hal sentinels.
func (e *BlasError) Is(target error) bool {
	switch target {
	case hal.ErrInvalid:
		return e.Status == 3 || e.Status == 4 || e.Status == 11
	case hal.ErrOutOfMemory:
		return e.Status == 5
	case hal.ErrClosed:
		return e.Status == 1
	case hal.ErrUnavailable:
		return e.Status == 2 || e.Status == 14 || e.Status == 15
	}
	return false
}

func blasCheck(a *rocblasAPI, call string, s int32) error {
	if s == 0 {
		return nil
	}
	name := rocblasStatusNames[s]
	if name == "" && a.statusToString != nil {
		name = a.statusToString(s)
	}
	if name == "" {
		name = "rocblas_status?"
	}
	return &BlasError{Call: call, Status: s, Name: name}
}

var errNoCapture = errors.New("this HIP runtime has no stream capture (hipStreamBeginCapture)")
