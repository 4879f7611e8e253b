package rocm

import (
	"fmt"
	"math"
	"sync"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// rocBLAS enum values (rocblas-types.h).
const (
	rbOpNone      int32 = 111 // rocblas_operation_none
	rbOpTranspose int32 = 112 // rocblas_operation_transpose

	rbF16R  int32 = 150 // rocblas_datatype_f16_r
	rbF32R  int32 = 151
	rbF64R  int32 = 152
	rbF32C  int32 = 154
	rbF64C  int32 = 155
	rbBF16R int32 = 168

	rbPointerModeHost int32 = 0 // rocblas_pointer_mode_host
	rbGemmAlgoStd     int32 = 0 // rocblas_gemm_algo_standard
	rbMathDefault     int32 = 0 // rocblas_default_math
	rbMathXF32        int32 = 1 // rocblas_xf32_xdl_math_op (MI300: TF32-like)
)

// handle implements hal.BlasHandle and hal.StreamBinder with one
// rocblas_handle.
type handle struct {
	d   *device
	api *rocblasAPI

	mu        sync.Mutex
	h         uintptr
	destroyed bool
	// alpha and beta are host scalars; rocBLAS reads them during the call.
	alpha, beta [2]float64
}

func newHandle(d *device, api *rocblasAPI) (*handle, error) {
	h := &handle{d: d, api: api}
	err := d.run("NewBlasHandle", func() error {
		if err := blasCheck(api, "rocblas_create_handle", api.createHandle(&h.h)); err != nil {
			return err
		}
		if err := blasCheck(api, "rocblas_set_pointer_mode", api.setPointerMode(h.h, rbPointerModeHost)); err != nil {
			_ = api.destroyHandle(h.h)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return h, nil
}

// SetStreamKeepsWorkspace is true: rocblas_set_stream leaves the workspace
// set by rocblas_set_workspace in place (rocBLAS docs, "Device Memory
// Allocation": the workspace is per handle, not per stream).
func (h *handle) SetStreamKeepsWorkspace() bool { return true }

// NeedsOldStreamIdle is true: rocBLAS docs ("Handle, Stream, and Device
// Management") ask that the old stream be synchronised before
// rocblas_set_stream moves a handle to another stream, because the handle's
// workspace is not per stream (ROCm/rocBLAS issue #1253).
func (h *handle) NeedsOldStreamIdle() bool { return true }

func (h *handle) lock(call string) error {
	h.mu.Lock()
	if h.destroyed {
		h.mu.Unlock()
		return fmt.Errorf("rocm: rocBLAS %s: handle destroyed: %w", call, hal.ErrClosed)
	}
	return nil
}

func (h *handle) call(name string, f func() int32) error {
	if err := h.d.run(name, func() error { return blasCheck(h.api, name, f()) }); err != nil {
		return err
	}
	return nil
}

// SetStream binds the handle to s (rocblas_set_stream); the workspace stays.
func (h *handle) SetStream(hs hal.Stream) error {
	s, ok := hs.(*stream)
	if !ok || s == nil {
		return fmt.Errorf("rocm: SetStream: stream %T is not a ROCm stream: %w", hs, hal.ErrInvalid)
	}
	if err := h.lock("SetStream"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	return h.call("rocblas_set_stream", func() int32 { return h.api.setStream(h.h, s.h) })
}

// SetWorkspace makes [p, p+n) the handle's user-owned workspace
// (rocblas_set_workspace).
func (h *handle) SetWorkspace(p hal.Ptr, n int) error {
	if err := h.lock("SetWorkspace"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	return h.call("rocblas_set_workspace", func() int32 { return h.api.setWorkspace(h.h, uintptr(p), uintptr(n)) })
}

// SetMathMode: MathTF32 asks for rocblas_xf32_xdl_math_op where rocBLAS has
// rocblas_set_math_mode (MI300); everything else is the default math.
func (h *handle) SetMathMode(m hal.MathMode) error {
	if err := h.lock("SetMathMode"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	mode := rbMathDefault
	switch m {
	case hal.MathDefault, hal.MathTensorOp:
	case hal.MathTF32:
		mode = rbMathXF32
	default:
		return fmt.Errorf("rocm: SetMathMode(%d): %w", int(m), hal.ErrInvalid)
	}
	if h.api.setMathMode == nil {
		return nil // older rocBLAS: default math only
	}
	err := h.call("rocblas_set_math_mode", func() int32 { return h.api.setMathMode(h.h, mode) })
	if err != nil && mode == rbMathXF32 {
		return nil // devices without xf32 keep the default math, as TF32 falls back on CUDA
	}
	return err
}

func rbType(d hal.DType) (int32, error) {
	switch d {
	case hal.F32:
		return rbF32R, nil
	case hal.F64:
		return rbF64R, nil
	case hal.F16:
		return rbF16R, nil
	case hal.BF16:
		return rbBF16R, nil
	case hal.C64:
		return rbF32C, nil
	case hal.C128:
		return rbF64C, nil
	}
	return 0, fmt.Errorf("dtype %v has no rocBLAS data type: %w", d, hal.ErrInvalid)
}

func rbOp(o hal.Op) (int32, error) {
	switch o {
	case hal.NoTrans:
		return rbOpNone, nil
	case hal.Trans:
		return rbOpTranspose, nil
	}
	return 0, fmt.Errorf("transpose flag %d: %w", int(o), hal.ErrInvalid)
}

// gemmArgs is a GemmDesc converted to rocBLAS arguments.
type gemmArgs struct {
	ta, tb, m, n, k, lda, ldb, ldc int32
	ab, c, compute                 int32
	complex                        bool
}

func i32(call, field string, v int) (int32, error) {
	if v < 0 || v > math.MaxInt32 {
		return 0, fmt.Errorf("rocm: %s: %s = %d does not fit rocblas_int: %w", call, field, v, hal.ErrInvalid)
	}
	return int32(v), nil
}

// convertGemm picks types (compute f32 for f16/bf16/f32, f64 for f64, the
// complex type itself for c64/c128) and checks int32 ranges.
func convertGemm(call string, d hal.GemmDesc) (gemmArgs, error) {
	var g gemmArgs
	var err error
	if g.ab, err = rbType(d.AB); err != nil {
		return g, fmt.Errorf("rocm: %s: A/B: %w", call, err)
	}
	if g.c, err = rbType(d.CType); err != nil {
		return g, fmt.Errorf("rocm: %s: C: %w", call, err)
	}
	switch {
	case d.AB == d.CType && (d.AB == hal.F32 || d.AB == hal.F64 || d.AB == hal.C64 || d.AB == hal.C128):
		g.compute = g.ab
		g.complex = d.AB == hal.C64 || d.AB == hal.C128
	case (d.AB == hal.F16 || d.AB == hal.BF16) && (d.CType == d.AB || d.CType == hal.F32):
		g.compute = rbF32R
	default:
		return g, fmt.Errorf("rocm: %s: %v inputs with %v output are not supported by rocblas_gemm_ex here: %w", call, d.AB, d.CType, hal.ErrInvalid)
	}
	if g.ta, err = rbOp(d.TransA); err != nil {
		return g, fmt.Errorf("rocm: %s: TransA: %w", call, err)
	}
	if g.tb, err = rbOp(d.TransB); err != nil {
		return g, fmt.Errorf("rocm: %s: TransB: %w", call, err)
	}
	for _, f := range []struct {
		name string
		v    int
		dst  *int32
	}{{"M", d.M, &g.m}, {"N", d.N, &g.n}, {"K", d.K, &g.k}, {"LDA", d.LDA, &g.lda}, {"LDB", d.LDB, &g.ldb}, {"LDC", d.LDC, &g.ldc}} {
		if *f.dst, err = i32(call, f.name, f.v); err != nil {
			return g, err
		}
	}
	return g, nil
}

// scalars sets alpha and beta in the host type of compute and returns
// pointers to them (f32: float; f64: double; f32_c: float2; f64_c: double2).
func (h *handle) scalars(compute int32, alpha, beta complex128) (unsafe.Pointer, unsafe.Pointer) {
	set := func(dst *[2]float64, v complex128) {
		switch compute {
		case rbF32R:
			*(*float32)(unsafe.Pointer(&dst[0])) = float32(real(v))
		case rbF32C:
			p := (*[2]float32)(unsafe.Pointer(&dst[0]))
			p[0], p[1] = float32(real(v)), float32(imag(v))
		case rbF64C:
			dst[0], dst[1] = real(v), imag(v)
		default:
			dst[0] = real(v)
		}
	}
	set(&h.alpha, alpha)
	set(&h.beta, beta)
	return unsafe.Pointer(&h.alpha), unsafe.Pointer(&h.beta)
}

func (h *handle) gemmEx(d hal.GemmDesc, g gemmArgs) int32 {
	al, be := h.scalars(g.compute, complex(d.Alpha, 0), complex(d.Beta, 0))
	return h.api.gemmEx(h.h, g.ta, g.tb, g.m, g.n, g.k,
		al, uintptr(d.A), g.ab, g.lda,
		uintptr(d.B), g.ab, g.ldb,
		be, uintptr(d.C), g.c, g.ldc,
		uintptr(d.C), g.c, g.ldc,
		g.compute, rbGemmAlgoStd, 0, 0)
}

// Gemm queues rocblas_gemm_ex (D = C) on the bound stream.
func (h *handle) Gemm(d hal.GemmDesc) error {
	if err := h.lock("Gemm"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	g, err := convertGemm("rocblas_gemm_ex", d)
	if err != nil {
		return err
	}
	return h.call("rocblas_gemm_ex", func() int32 { return h.gemmEx(d, g) })
}

// GemmStridedBatched queues rocblas_gemm_strided_batched_ex on the bound stream.
func (h *handle) GemmStridedBatched(d hal.GemmDesc, b hal.StridedBatch) error {
	if err := h.lock("GemmStridedBatched"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	const call = "rocblas_gemm_strided_batched_ex"
	g, err := convertGemm(call, d)
	if err != nil {
		return err
	}
	count, err := i32(call, "Count", b.Count)
	if err != nil {
		return err
	}
	al, be := h.scalars(g.compute, complex(d.Alpha, 0), complex(d.Beta, 0))
	return h.call(call, func() int32 {
		return h.api.gemmStridedBatchedEx(h.h, g.ta, g.tb, g.m, g.n, g.k,
			al, uintptr(d.A), g.ab, g.lda, b.StrideA,
			uintptr(d.B), g.ab, g.ldb, b.StrideB,
			be, uintptr(d.C), g.c, g.ldc, b.StrideC,
			uintptr(d.C), g.c, g.ldc, b.StrideC,
			count, g.compute, rbGemmAlgoStd, 0, 0)
	})
}

// GemmGrouped runs one rocblas_gemm_ex per desc, in order, on the bound
// stream: rocBLAS has no grouped GEMM.
func (h *handle) GemmGrouped(ds []hal.GemmDesc) error {
	if err := h.lock("GemmGrouped"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	for i, d := range ds {
		g, err := convertGemm("rocblas_gemm_ex", d)
		if err != nil {
			return fmt.Errorf("group %d: %w", i, err)
		}
		if err := h.call("rocblas_gemm_ex", func() int32 { return h.gemmEx(d, g) }); err != nil {
			return fmt.Errorf("group %d: %w", i, err)
		}
	}
	return nil
}

// Geam queues rocblas_{s,d,c,z}geam on the bound stream.
func (h *handle) Geam(d hal.GeamDesc) error {
	if err := h.lock("Geam"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	var fn geamFn
	var name string
	var compute int32
	switch d.Type {
	case hal.F32:
		fn, name, compute = h.api.sgeam, "rocblas_sgeam", rbF32R
	case hal.F64:
		fn, name, compute = h.api.dgeam, "rocblas_dgeam", rbF64R
	case hal.C64:
		fn, name, compute = h.api.cgeam, "rocblas_cgeam", rbF32C
	case hal.C128:
		fn, name, compute = h.api.zgeam, "rocblas_zgeam", rbF64C
	default:
		return fmt.Errorf("rocm: Geam: dtype %v is not supported; use f32, f64, c64 or c128: %w", d.Type, hal.ErrInvalid)
	}
	ta, err := rbOp(d.TransA)
	if err != nil {
		return fmt.Errorf("rocm: %s: TransA: %w", name, err)
	}
	tb, err := rbOp(d.TransB)
	if err != nil {
		return fmt.Errorf("rocm: %s: TransB: %w", name, err)
	}
	var m, n, lda, ldb, ldc int32
	for _, f := range []struct {
		name string
		v    int
		dst  *int32
	}{{"M", d.M, &m}, {"N", d.N, &n}, {"LDA", d.LDA, &lda}, {"LDB", d.LDB, &ldb}, {"LDC", d.LDC, &ldc}} {
		if *f.dst, err = i32(name, f.name, f.v); err != nil {
			return err
		}
	}
	al, be := h.scalars(compute, d.Alpha, d.Beta)
	return h.call(name, func() int32 {
		return fn(h.h, ta, tb, m, n, al, uintptr(d.A), lda, be, uintptr(d.B), ldb, uintptr(d.C), ldc)
	})
}

// GroupedNative is false: rocBLAS has no grouped GEMM.
func (h *handle) GroupedNative() bool { return false }

// Destroy destroys the rocBLAS handle. A second Destroy returns nil.
func (h *handle) Destroy() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.destroyed {
		return nil
	}
	h.destroyed = true
	return h.call("rocblas_destroy_handle", func() int32 { return h.api.destroyHandle(h.h) })
}
