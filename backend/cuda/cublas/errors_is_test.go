package cublas

import (
	"errors"
	"testing"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// sentinels are every hal sentinel an error of this package could mean.
var sentinels = []error{hal.ErrClosed, hal.ErrFreed, hal.ErrWrongDevice, hal.ErrSize, hal.ErrInvalid,
	hal.ErrHandleExpired, hal.ErrUnavailable, hal.ErrNoKernel, hal.ErrBadPointer, hal.ErrOutOfMemory, hal.ErrDeviceLost}

// TestErrorsIs: each status and CUresult matches exactly the hal sentinels
// it means (and so gpuctx's), also when wrapped; an out-of-memory while
// staging a grouped GEMM is gpuctx.ErrOutOfMemory.
func TestErrorsIs(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		is   []error
	}{
		{"staging out of memory", &DriverError{Call: "cuMemAlloc_v2", Result: 2}, []error{hal.ErrOutOfMemory}},
		{"pinned staging out of memory", &DriverError{Call: "cuMemAllocHost_v2", Result: 2}, []error{hal.ErrOutOfMemory}},
		{"driver invalid value", &DriverError{Call: "cuMemcpyHtoDAsync_v2", Result: 1}, []error{hal.ErrInvalid}},
		{"driver invalid handle", &DriverError{Call: "cuEventRecord", Result: 400}, []error{hal.ErrInvalid}},
		{"driver no device", &DriverError{Call: "cuMemAlloc_v2", Result: 100}, []error{hal.ErrUnavailable}},
		{"driver deinitialized", &DriverError{Call: "cuMemAlloc_v2", Result: 4}, []error{hal.ErrUnavailable}},
		{"driver context destroyed", &DriverError{Call: "cuEventRecord", Result: 709}, []error{hal.ErrClosed}},
		{"driver illegal address", &DriverError{Call: "cuEventSynchronize", Result: 700}, []error{hal.ErrDeviceLost}},
		{"driver launch failed", &DriverError{Call: "cuStreamSynchronize", Result: 719}, []error{hal.ErrDeviceLost}},
		{"driver not ready", &DriverError{Call: "cuEventQuery", Result: 600}, nil},
		{"alloc failed", &StatusError{Call: "cublasGemmGroupedBatchedEx", Status: 3}, []error{hal.ErrOutOfMemory}},
		{"invalid value", &StatusError{Call: "cublasGemmEx", Status: 7}, []error{hal.ErrInvalid}},
		{"not initialized", &StatusError{Call: "cublasCreate_v2", Status: 1}, []error{hal.ErrUnavailable}},
		{"arch mismatch", &StatusError{Call: "cublasGemmEx", Status: 8}, []error{hal.ErrUnavailable}},
		{"not supported", &StatusError{Call: "cublasLtMatmul", Status: 15}, []error{hal.ErrUnavailable}},
		{"license", &StatusError{Call: "cublasGemmEx", Status: 16}, []error{hal.ErrUnavailable}},
		{"execution failed", &StatusError{Call: "cublasGemmEx", Status: 13}, nil},
		{"internal", &StatusError{Call: "cublasGemmEx", Status: 14}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, err := range []error{tc.err, errors.Join(errors.New("cublas: staging"), tc.err)} {
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

// TestGroupedStagingOutOfMemory: the pointer arrays of a native grouped GEMM
// are staged in device memory; when that allocation fails, the error the
// handle returns matches hal.ErrOutOfMemory (gpuctx.ErrOutOfMemory).
func TestGroupedStagingOutOfMemory(t *testing.T) {
	f := newFake(true)
	h := f.newHandle(t, 9)
	defer h.Destroy()
	h.st.d.memAlloc = func(*uintptr, uint64) int32 { return 2 } // CUDA_ERROR_OUT_OF_MEMORY
	err := h.GemmGrouped(groupedDescs(hal.F32, hal.F32, 2, 2))
	if !errors.Is(err, hal.ErrOutOfMemory) {
		t.Fatalf("GemmGrouped with staging out of memory = %v, want hal.ErrOutOfMemory", err)
	}
}
