package cublas

import (
	"fmt"

	"github.com/gpuctx/gpuctx/internal/dynload"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// StatusError is a failed cuBLAS or cuBLASLt call. Its message names the call
// and the status, e.g. "cublasGemmEx: CUBLAS_STATUS_INVALID_VALUE (7)".
type StatusError struct {
	Call   string // the C function, e.g. "cublasGemmEx"
	Status int    // the cublasStatus_t value
	Name   string // e.g. "CUBLAS_STATUS_INVALID_VALUE"
	Detail string // the library's description, if it gave one
}

// Error formats the call, the status name and number, and the description.
func (e *StatusError) Error() string {
	s := fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Status)
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s
}

// Is maps the status to the hal sentinel it means (and so gpuctx's):
// CUBLAS_STATUS_ALLOC_FAILED is hal.ErrOutOfMemory, INVALID_VALUE
// hal.ErrInvalid, and NOT_INITIALIZED, ARCH_MISMATCH, NOT_SUPPORTED and
// LICENSE_ERROR hal.ErrUnavailable.
func (e *StatusError) Is(target error) bool {
	switch target {
	case hal.ErrOutOfMemory:
		return e.Status == 3
	case hal.ErrInvalid:
		return e.Status == 7
	case hal.ErrUnavailable:
		switch e.Status {
		case 1, 8, 15, 16:
			return true
		}
	}
	return false
}

// DriverError is a failed CUDA driver call made by this package (the staging
// of pointer arrays for grouped GEMM).
type DriverError struct {
	Call   string // e.g. "cuMemAlloc_v2"
	Result int    // the CUresult value
	Name   string // e.g. "CUDA_ERROR_OUT_OF_MEMORY"
}

// Error formats the call and the result name and number.
func (e *DriverError) Error() string {
	return fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Result)
}

// Is maps the CUresult to the hal sentinel it means (and so gpuctx's), as
// package cuda's Error does: CUDA_ERROR_OUT_OF_MEMORY is hal.ErrOutOfMemory
// (a grouped GEMM's staging that runs out of memory matches
// gpuctx.ErrOutOfMemory), INVALID_VALUE and INVALID_HANDLE hal.ErrInvalid, a
// missing device or driver hal.ErrUnavailable, CONTEXT_IS_DESTROYED
// hal.ErrClosed, and the sticky statuses hal.ErrDeviceLost.
func (e *DriverError) Is(target error) bool {
	switch target {
	case hal.ErrOutOfMemory:
		return e.Result == 2
	case hal.ErrInvalid:
		return e.Result == 1 || e.Result == 400
	case hal.ErrUnavailable:
		switch e.Result {
		case 3, 4, 34, 35, 100:
			return true
		}
	case hal.ErrClosed:
		return e.Result == 709
	case hal.ErrDeviceLost:
		switch e.Result {
		case 214, 700, 702, 710, 714, 715, 716, 717, 718, 719: // cuda.h's sticky statuses
			return true
		}
	}
	return false
}

// statusNames are the cublasStatus_t names, used when the library does not
// export cublasGetStatusName (or is a test fake).
var statusNames = map[int32]string{
	0:  "CUBLAS_STATUS_SUCCESS",
	1:  "CUBLAS_STATUS_NOT_INITIALIZED",
	3:  "CUBLAS_STATUS_ALLOC_FAILED",
	7:  "CUBLAS_STATUS_INVALID_VALUE",
	8:  "CUBLAS_STATUS_ARCH_MISMATCH",
	11: "CUBLAS_STATUS_MAPPING_ERROR",
	13: "CUBLAS_STATUS_EXECUTION_FAILED",
	14: "CUBLAS_STATUS_INTERNAL_ERROR",
	15: "CUBLAS_STATUS_NOT_SUPPORTED",
	16: "CUBLAS_STATUS_LICENSE_ERROR",
}

// statusError turns status s of call into an error, or nil on success.
func (a *blasAPI) statusError(call string, s int32) error {
	if s == 0 {
		return nil
	}
	e := &StatusError{Call: call, Status: int(s)}
	if a != nil && a.statusName != nil {
		e.Name = a.statusName(s)
	}
	if e.Name == "" || e.Name == "CUBLAS_STATUS_UNKNOWN" || e.Name == "<unknown>" {
		if n, ok := statusNames[s]; ok {
			e.Name = n
		} else {
			e.Name = "CUBLAS_STATUS_UNKNOWN"
		}
	}
	if a != nil && a.statusString != nil {
		e.Detail = a.statusString(s)
	}
	return e
}

// driverError turns CUresult r of call into an error, or nil on success.
func (a *drvAPI) driverError(call string, r int32) error {
	if r == 0 {
		return nil
	}
	e := &DriverError{Call: call, Result: int(r)}
	if a != nil && a.errorName != nil {
		var p *byte
		if a.errorName(r, &p) == 0 {
			e.Name = dynload.CString(p)
		}
	}
	if e.Name == "" {
		e.Name = "CUDA_ERROR_UNKNOWN"
	}
	return e
}
