package cublas

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// cudaDataType_t values (library_types.h).
const (
	cudaR32F  int32 = 0
	cudaR64F  int32 = 1
	cudaR16F  int32 = 2
	cudaC32F  int32 = 4
	cudaC64F  int32 = 5
	cudaR16BF int32 = 14
)

// cublasComputeType_t values (cublas_api.h).
const (
	computeF32         int32 = 68 // CUBLAS_COMPUTE_32F
	computeF32FastTF32 int32 = 77 // CUBLAS_COMPUTE_32F_FAST_TF32
	computeF64         int32 = 70 // CUBLAS_COMPUTE_64F
)

// cublasMath_t values.
const (
	mathDefault       int32 = 0 // CUBLAS_DEFAULT_MATH
	mathTF32TensorOp  int32 = 3 // CUBLAS_TF32_TENSOR_OP_MATH
	pointerModeHost   int32 = 0 // CUBLAS_POINTER_MODE_HOST
	gemmDefaultAlgo   int32 = -1
	opN               int32 = 0 // CUBLAS_OP_N
	opT               int32 = 1 // CUBLAS_OP_T
	ltDescTransA      int32 = 3 // CUBLASLT_MATMUL_DESC_TRANSA
	ltDescTransB      int32 = 4 // CUBLASLT_MATMUL_DESC_TRANSB
	ltPrefMaxWorkspce int32 = 1 // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
)

// dataType maps a hal dtype to its cudaDataType_t.
func dataType(d hal.DType) (int32, error) {
	switch d {
	case hal.F32:
		return cudaR32F, nil
	case hal.F64:
		return cudaR64F, nil
	case hal.F16:
		return cudaR16F, nil
	case hal.BF16:
		return cudaR16BF, nil
	case hal.C64:
		return cudaC32F, nil
	case hal.C128:
		return cudaC64F, nil
	}
	return 0, fmt.Errorf("cublas: dtype %v has no cuBLAS data type; use f32, f64, f16, bf16, c64 or c128", d)
}

// op maps a transpose flag to cublasOperation_t.
func op(o hal.Op) (int32, error) {
	switch o {
	case hal.NoTrans:
		return opN, nil
	case hal.Trans:
		return opT, nil
	}
	return 0, fmt.Errorf("cublas: transpose flag %d is invalid; use hal.NoTrans or hal.Trans", int(o))
}

// mathModeValue maps a hal math mode to the cublasMath_t to set and whether f32
// GEMMs should use the TF32 compute type. MathTensorOp maps to
// CUBLAS_DEFAULT_MATH because since cuBLAS 11 the default math mode already
// uses tensor cores for f16/bf16 inputs (CUBLAS_TENSOR_OP_MATH is deprecated).
// On devices older than compute capability 8.0 TF32 does not exist, so MathTF32
// falls back to the default mode and plain f32 compute there.
func mathModeValue(m hal.MathMode, computeMajor int) (mode int32, tf32 bool, err error) {
	switch m {
	case hal.MathDefault, hal.MathTensorOp:
		return mathDefault, false, nil
	case hal.MathTF32:
		if computeMajor > 0 && computeMajor < 8 {
			return mathDefault, false, nil
		}
		return mathTF32TensorOp, true, nil
	}
	return 0, false, fmt.Errorf("cublas: math mode %d is invalid; use hal.MathDefault, hal.MathTensorOp or hal.MathTF32", int(m))
}

// scaleKind is the host type of alpha and beta for a compute type.
type scaleKind int

const (
	scaleF32 scaleKind = iota // float
	scaleF64                  // double
	scaleC32                  // cuComplex
	scaleC64                  // cuDoubleComplex
)

// gemmTypes is what cublasGemmEx needs besides shapes and pointers.
type gemmTypes struct {
	ab, c   int32 // cudaDataType_t of A/B and of C
	compute int32 // cublasComputeType_t
	scale   scaleKind
}

// gemmTypesFor picks data, compute and scale types for a GEMM with inputs ab
// and output c. Supported pairs (cuBLAS GemmEx table): f32->f32, f64->f64,
// f16->{f16,f32}, bf16->{bf16,f32}, c64->c64, c128->c128. tf32 selects
// CUBLAS_COMPUTE_32F_FAST_TF32 for f32 and c64 inputs.
func gemmTypesFor(ab, c hal.DType, tf32 bool) (gemmTypes, error) {
	ok := false
	switch ab {
	case hal.F32, hal.F64, hal.C64, hal.C128:
		ok = c == ab
	case hal.F16, hal.BF16:
		ok = c == ab || c == hal.F32
	}
	if !ok {
		return gemmTypes{}, fmt.Errorf("cublas: GEMM with A/B %v and C %v is not supported; use C equal to A/B, or f32 C for f16/bf16 inputs", ab, c)
	}
	abT, _ := dataType(ab)
	cT, _ := dataType(c)
	t := gemmTypes{ab: abT, c: cT}
	switch ab {
	case hal.F32:
		t.compute, t.scale = computeF32, scaleF32
		if tf32 {
			t.compute = computeF32FastTF32
		}
	case hal.F16, hal.BF16:
		t.compute, t.scale = computeF32, scaleF32
	case hal.F64:
		t.compute, t.scale = computeF64, scaleF64
	case hal.C64:
		t.compute, t.scale = computeF32, scaleC32
		if tf32 {
			t.compute = computeF32FastTF32
		}
	case hal.C128:
		t.compute, t.scale = computeF64, scaleC64
	}
	return t, nil
}

// scalar is host storage for one alpha or beta of any scale kind, big enough
// for a cuDoubleComplex. Its value lives at ptr(), which is 16-byte aligned:
// cuBLAS reads cuDoubleComplex scalars with aligned 16-byte loads (an 8-byte
// aligned one faults). Go heap and stack moves keep 16-byte alignment, so
// ptr() is stable for a value that is not copied.
type scalar [4]uint64

// set stores v as the C type of kind k.
func (s *scalar) set(k scaleKind, v complex128) {
	*s = scalar{}
	p := s.ptr()
	switch k {
	case scaleF32:
		*(*float32)(p) = float32(real(v))
	case scaleF64:
		*(*float64)(p) = real(v)
	case scaleC32:
		*(*complex64)(p) = complex64(v)
	case scaleC64:
		*(*complex128)(p) = v
	}
}

// ptr returns the 16-byte aligned address of the stored scalar.
func (s *scalar) ptr() unsafe.Pointer {
	p := unsafe.Pointer(s)
	if uintptr(p)%16 != 0 {
		p = unsafe.Add(p, 8)
	}
	return p
}

// i32 converts a dimension, leading dimension or count to a C int, naming the
// field when it does not fit.
func i32(call, field string, v int) (int32, error) {
	if v < math.MinInt32 || v > math.MaxInt32 {
		return 0, fmt.Errorf("%s: %s = %d does not fit a 32-bit int; split the operation", call, field, v)
	}
	return int32(v), nil
}

// formatVersion turns a cuBLAS/cuBLASLt version number
// (major*10000 + minor*100 + patch, e.g. 130100) into "13.1.0".
func formatVersion(v int) string {
	if v <= 0 {
		return ""
	}
	return fmt.Sprintf("%d.%d.%d", v/10000, v%10000/100, v%100)
}
