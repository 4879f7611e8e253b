package cuda

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/gpuctx/gpuctx/internal/dynload"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// CUresult values this package treats specially (cuda.h).
const (
	cudaSuccess              = 0
	cudaErrorInvalidValue    = 1
	cudaErrorOutOfMemory     = 2
	cudaErrorNotInitialized  = 3
	cudaErrorDeinitialized   = 4
	cudaErrorStubLibrary     = 34
	cudaErrorInsufficientDrv = 35
	cudaErrorNoDevice        = 100
	cudaErrorInvalidDevice   = 101
	cudaErrorNoBinaryForGPU  = 209
	cudaErrorInvalidPTX      = 218
	cudaErrorUnsupportedPTX  = 222
	cudaErrorCtxDestroyed    = 709
	cudaErrorInvalidHandle   = 400
	cudaErrorNotFound        = 500
	cudaErrorNotReady        = 600
	cudaErrorIllegalAddress  = 700
	cudaErrorLaunchFailed    = 719

	// Sticky statuses: the context is unusable after them (cuda.h).
	cudaErrorECCUncorrectable   = 214
	cudaErrorLaunchTimeout      = 702
	cudaErrorAssert             = 710
	cudaErrorHardwareStackError = 714
	cudaErrorIllegalInstruction = 715
	cudaErrorMisalignedAddress  = 716
	cudaErrorInvalidAddrSpace   = 717
	cudaErrorInvalidPC          = 718
)

// errorNames are used when cuGetErrorName is unavailable (the driver failed to
// load far enough) so that errors still name the status.
var errorNames = map[int32]string{
	cudaErrorInvalidValue:    "CUDA_ERROR_INVALID_VALUE",
	cudaErrorOutOfMemory:     "CUDA_ERROR_OUT_OF_MEMORY",
	cudaErrorNotInitialized:  "CUDA_ERROR_NOT_INITIALIZED",
	cudaErrorDeinitialized:   "CUDA_ERROR_DEINITIALIZED",
	cudaErrorStubLibrary:     "CUDA_ERROR_STUB_LIBRARY",
	cudaErrorInsufficientDrv: "CUDA_ERROR_INSUFFICIENT_DRIVER",
	cudaErrorNoDevice:        "CUDA_ERROR_NO_DEVICE",
	cudaErrorInvalidDevice:   "CUDA_ERROR_INVALID_DEVICE",
	cudaErrorNoBinaryForGPU:  "CUDA_ERROR_NO_BINARY_FOR_GPU",
	cudaErrorInvalidPTX:      "CUDA_ERROR_INVALID_PTX",
	cudaErrorUnsupportedPTX:  "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
	cudaErrorInvalidHandle:   "CUDA_ERROR_INVALID_HANDLE",
	cudaErrorNotFound:        "CUDA_ERROR_NOT_FOUND",
	cudaErrorNotReady:        "CUDA_ERROR_NOT_READY",
	cudaErrorIllegalAddress:  "CUDA_ERROR_ILLEGAL_ADDRESS",
	cudaErrorLaunchFailed:    "CUDA_ERROR_LAUNCH_FAILED",

	cudaErrorECCUncorrectable:   "CUDA_ERROR_ECC_UNCORRECTABLE",
	cudaErrorLaunchTimeout:      "CUDA_ERROR_LAUNCH_TIMEOUT",
	cudaErrorAssert:             "CUDA_ERROR_ASSERT",
	cudaErrorHardwareStackError: "CUDA_ERROR_HARDWARE_STACK_ERROR",
	cudaErrorIllegalInstruction: "CUDA_ERROR_ILLEGAL_INSTRUCTION",
	cudaErrorMisalignedAddress:  "CUDA_ERROR_MISALIGNED_ADDRESS",
	cudaErrorInvalidAddrSpace:   "CUDA_ERROR_INVALID_ADDRESS_SPACE",
	cudaErrorInvalidPC:          "CUDA_ERROR_INVALID_PC",
}

// stickyCode reports whether a CUresult leaves the context unusable: after it
// every later driver call in the process's context fails (cuda.h: "the process
// must be terminated and relaunched").
func stickyCode(r int32) bool {
	switch r {
	case cudaErrorECCUncorrectable, cudaErrorIllegalAddress, cudaErrorLaunchTimeout, cudaErrorAssert,
		cudaErrorHardwareStackError, cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
		cudaErrorInvalidAddrSpace, cudaErrorInvalidPC, cudaErrorLaunchFailed:
		return true
	}
	return false
}

// DeviceLostError is returned by every call on a device after a sticky error.
// It matches hal.ErrDeviceLost (and so gpuctx.ErrDeviceLost) and unwraps to the
// first sticky error.
type DeviceLostError struct {
	Device int
	First  error // the first sticky failure, an *Error
}

func (e *DeviceLostError) Error() string {
	return fmt.Sprintf("cuda: device %d: %v (the context is unusable; every later call fails until the process restarts): first failure: %v",
		e.Device, hal.ErrDeviceLost, e.First)
}

// Is matches hal.ErrDeviceLost.
func (e *DeviceLostError) Is(target error) bool { return target == hal.ErrDeviceLost }

// Unwrap returns the first sticky failure.
func (e *DeviceLostError) Unwrap() error { return e.First }

// stickyState records a device's first sticky error. Safe for concurrent use.
type stickyState struct {
	lost atomic.Pointer[DeviceLostError]
}

// err returns the device-lost error once a sticky error was seen, else nil.
func (s *stickyState) err() error {
	if l := s.lost.Load(); l != nil {
		return l
	}
	return nil
}

// note inspects err, the result of a driver call on device dev: a sticky
// status is recorded (the first one wins) and turned into the device-lost
// error; any other error is returned unchanged.
func (s *stickyState) note(dev int, err error) error {
	var ce *Error
	if err == nil || !errors.As(err, &ce) || !stickyCode(ce.Code) {
		return err
	}
	s.lost.CompareAndSwap(nil, &DeviceLostError{Device: dev, First: err})
	if first := s.lost.Load(); first.First != err {
		// Another call saw a sticky error first: name it, keep this one too.
		return fmt.Errorf("%w (this call: %v)", first, err)
	}
	return s.lost.Load()
}

// Error is a failed CUDA driver call. It formats as
// "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory".
type Error struct {
	Call string // driver function, e.g. "cuMemAlloc_v2"
	Code int32  // the CUresult
	Name string // cuGetErrorName, e.g. "CUDA_ERROR_OUT_OF_MEMORY"
	Desc string // cuGetErrorString, may be empty
}

// Error formats the call, the status name and number, and the description.
func (e *Error) Error() string {
	name := e.Name
	if name == "" {
		name = "CUDA_ERROR_UNKNOWN_STATUS"
	}
	s := fmt.Sprintf("%s: %s (%d)", e.Call, name, e.Code)
	if e.Desc != "" {
		s += ": " + e.Desc
	}
	return s
}

// Is reports whether target is the same status: a *Error with the same Code
// (the sentinels below), or the hal sentinel the status means (and so
// gpuctx's): hal.ErrUnavailable for a missing device or driver,
// hal.ErrOutOfMemory, hal.ErrInvalid for an invalid value, handle or device,
// hal.ErrNoKernel for a kernel missing from its module, hal.ErrClosed for a
// destroyed context, and hal.ErrDeviceLost for the sticky statuses.
func (e *Error) Is(target error) bool {
	if t, ok := target.(*Error); ok {
		return t.Code == e.Code && (t.Call == "" || t.Call == e.Call)
	}
	switch target {
	case hal.ErrUnavailable:
		switch e.Code {
		case cudaErrorNoDevice, cudaErrorStubLibrary, cudaErrorInsufficientDrv, cudaErrorNotInitialized, cudaErrorDeinitialized:
			return true
		}
	case hal.ErrOutOfMemory:
		return e.Code == cudaErrorOutOfMemory
	case hal.ErrInvalid:
		return e.Code == cudaErrorInvalidValue || e.Code == cudaErrorInvalidHandle || e.Code == cudaErrorInvalidDevice
	case hal.ErrNoKernel:
		return e.Code == cudaErrorNotFound && e.Call == "cuModuleGetFunction"
	case hal.ErrClosed:
		return e.Code == cudaErrorCtxDestroyed
	case hal.ErrDeviceLost:
		return stickyCode(e.Code)
	}
	return false
}

// Sentinels for errors.Is; they match any call that failed with that status.
var (
	ErrOutOfMemory   = &Error{Code: cudaErrorOutOfMemory, Name: "CUDA_ERROR_OUT_OF_MEMORY"}
	ErrInvalidValue  = &Error{Code: cudaErrorInvalidValue, Name: "CUDA_ERROR_INVALID_VALUE"}
	ErrInvalidHandle = &Error{Code: cudaErrorInvalidHandle, Name: "CUDA_ERROR_INVALID_HANDLE"}
	ErrLaunchFailed  = &Error{Code: cudaErrorLaunchFailed, Name: "CUDA_ERROR_LAUNCH_FAILED"}
	ErrIllegalAddr   = &Error{Code: cudaErrorIllegalAddress, Name: "CUDA_ERROR_ILLEGAL_ADDRESS"}
	ErrNoDevice      = &Error{Code: cudaErrorNoDevice, Name: "CUDA_ERROR_NO_DEVICE"}
)

// check turns a CUresult into nil or an *Error naming call. api may be nil or
// partly bound; then the fallback name table is used.
func check(api *driverAPI, call string, r int32) error {
	if r == cudaSuccess {
		return nil
	}
	e := &Error{Call: call, Code: r}
	if api != nil && api.cuGetErrorName != nil {
		var p *byte
		if api.cuGetErrorName(r, &p) == cudaSuccess {
			e.Name = dynload.CString(p)
		}
	}
	if api != nil && api.cuGetErrorString != nil {
		var p *byte
		if api.cuGetErrorString(r, &p) == cudaSuccess {
			e.Desc = dynload.CString(p)
		}
	}
	if e.Name == "" {
		e.Name = errorNames[r]
	}
	return e
}
