package cublas

import (
	"errors"
	"fmt"
	"sync"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// handle is a cuBLAS handle (hal.BlasHandle). All work is queued on stream,
// the CUstream of the last SetStream (0, the legacy default stream, before).
type handle struct {
	mu sync.Mutex // guards every field below; held across each library call

	st           *state
	r            hal.Runner
	h            uintptr // cublasHandle_t
	major, minor int     // compute capability
	stream       uintptr // CUstream bound by the last SetStream
	tf32         bool    // MathTF32 set: f32 GEMMs use CUBLAS_COMPUTE_32F_FAST_TF32
	// native: GemmGrouped uses cublasGemmGroupedBatchedEx (for the dtypes it
	// supports). Tests clear it to force the GemmEx loop.
	native    bool
	destroyed bool

	alpha, beta scalar  // host scalars passed by pointer (host pointer mode)
	scr         scratch // staging of device pointer arrays for grouped GEMM
}

// lock locks h and fails if it was destroyed.
func (h *handle) lock(call string) error {
	h.mu.Lock()
	if h.destroyed {
		h.mu.Unlock()
		return fmt.Errorf("cublas: %s on a destroyed handle: %w", call, hal.ErrClosed)
	}
	return nil
}

// call runs f inside the runner and turns its status into an error naming name.
func (h *handle) call(name string, f func() int32) error {
	return h.r.Do(func() error { return h.st.b.statusError(name, f()) })
}

// SetStream binds the handle to s with cublasSetStream_v2; later operations
// are queued on s. It does not wait for work on the previously bound stream.
// cuBLAS resets the handle's workspace to its default pool here: call
// SetWorkspace right after. s must implement hal.RawStream.
func (h *handle) SetStream(s hal.Stream) error {
	raw, err := rawStream("cublasSetStream_v2", s)
	if err != nil {
		return err
	}
	if err := h.lock("SetStream"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	if err := h.call("cublasSetStream_v2", func() int32 { return h.st.b.setStream(h.h, raw) }); err != nil {
		return err
	}
	h.stream = raw
	return nil
}

// SetWorkspace makes [p, p+n) the handle's workspace (cublasSetWorkspace_v2).
// The memory must not be used by any other stream while work queued through
// this handle may still run. It queues no GPU work.
func (h *handle) SetWorkspace(p hal.Ptr, n int) error {
	if n < 0 {
		return fmt.Errorf("cublasSetWorkspace_v2: size %d is negative; pass the workspace size in bytes", n)
	}
	if err := h.lock("SetWorkspace"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	return h.call("cublasSetWorkspace_v2", func() int32 { return h.st.b.setWorkspace(h.h, uintptr(p), uint64(n)) })
}

// SetMathMode sets the math mode (cublasSetMathMode). MathDefault and
// MathTensorOp both map to CUBLAS_DEFAULT_MATH (tensor cores are used for
// f16/bf16 by default since cuBLAS 11); MathTF32 maps to
// CUBLAS_TF32_TENSOR_OP_MATH and makes f32 GEMMs use
// CUBLAS_COMPUTE_32F_FAST_TF32 (on devices older than 8.0 it is the default).
// It queues no GPU work.
func (h *handle) SetMathMode(m hal.MathMode) error {
	mode, tf32, err := mathModeValue(m, h.major)
	if err != nil {
		return err
	}
	if err := h.lock("SetMathMode"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	if err := h.call("cublasSetMathMode", func() int32 { return h.st.b.setMathMode(h.h, mode) }); err != nil {
		return err
	}
	h.tf32 = tf32
	return nil
}

// gemmArgs is a GemmDesc converted to cuBLAS arguments.
type gemmArgs struct {
	ta, tb        int32
	m, n, k       int32
	lda, ldb, ldc int32
	t             gemmTypes
}

// convertGemm converts d for call, checking enums and int32 ranges.
func convertGemm(call string, d hal.GemmDesc, tf32 bool) (gemmArgs, error) {
	var g gemmArgs
	var err error
	if g.t, err = gemmTypesFor(d.AB, d.CType, tf32); err != nil {
		return g, fmt.Errorf("%s: %w", call, err)
	}
	if g.ta, err = op(d.TransA); err != nil {
		return g, fmt.Errorf("%s: TransA: %w", call, err)
	}
	if g.tb, err = op(d.TransB); err != nil {
		return g, fmt.Errorf("%s: TransB: %w", call, err)
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

// gemmEx queues one cublasGemmEx; h is locked and inside the runner or about
// to be (the caller decides).
func (h *handle) gemmEx(d hal.GemmDesc, g gemmArgs) int32 {
	h.alpha.set(g.t.scale, complex(d.Alpha, 0))
	h.beta.set(g.t.scale, complex(d.Beta, 0))
	return h.st.b.gemmEx(h.h, g.ta, g.tb, g.m, g.n, g.k,
		h.alpha.ptr(), uintptr(d.A), g.t.ab, g.lda,
		uintptr(d.B), g.t.ab, g.ldb,
		h.beta.ptr(), uintptr(d.C), g.t.c, g.ldc,
		g.t.compute, gemmDefaultAlgo)
}

// Gemm queues C = alpha*op(A)*op(B) + beta*C (cublasGemmEx) on the bound
// stream and returns without waiting for it. The compute type is
// CUBLAS_COMPUTE_32F for f16/bf16/f32 inputs (…_FAST_TF32 for f32 under
// MathTF32) and CUBLAS_COMPUTE_64F for f64.
func (h *handle) Gemm(d hal.GemmDesc) error {
	if err := h.lock("Gemm"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	g, err := convertGemm("cublasGemmEx", d, h.tf32)
	if err != nil {
		return err
	}
	return h.call("cublasGemmEx", func() int32 { return h.gemmEx(d, g) })
}

// GemmStridedBatched queues b.Count GEMMs (cublasGemmStridedBatchedEx) on the
// bound stream, matrix i at A + i*StrideA elements (likewise B and C), and
// returns without waiting.
func (h *handle) GemmStridedBatched(d hal.GemmDesc, b hal.StridedBatch) error {
	if err := h.lock("GemmStridedBatched"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	const call = "cublasGemmStridedBatchedEx"
	g, err := convertGemm(call, d, h.tf32)
	if err != nil {
		return err
	}
	count, err := i32(call, "Count", b.Count)
	if err != nil {
		return err
	}
	h.alpha.set(g.t.scale, complex(d.Alpha, 0))
	h.beta.set(g.t.scale, complex(d.Beta, 0))
	return h.call(call, func() int32 {
		return h.st.b.gemmStridedBatchedEx(h.h, g.ta, g.tb, g.m, g.n, g.k,
			h.alpha.ptr(), uintptr(d.A), g.t.ab, g.lda, b.StrideA,
			uintptr(d.B), g.t.ab, g.ldb, b.StrideB,
			h.beta.ptr(), uintptr(d.C), g.t.c, g.ldc, b.StrideC,
			count, g.t.compute, gemmDefaultAlgo)
	})
}

// Geam queues C = alpha*op(A) + beta*op(B) (cublas{S,D,C,Z}geam) on the bound
// stream and returns without waiting. Real types use the real parts of Alpha
// and Beta.
func (h *handle) Geam(d hal.GeamDesc) error {
	if err := h.lock("Geam"); err != nil {
		return err
	}
	defer h.mu.Unlock()
	var fn geamFn
	var name string
	var k scaleKind
	switch d.Type {
	case hal.F32:
		fn, name, k = h.st.b.sgeam, "cublasSgeam", scaleF32
	case hal.F64:
		fn, name, k = h.st.b.dgeam, "cublasDgeam", scaleF64
	case hal.C64:
		fn, name, k = h.st.b.cgeam, "cublasCgeam", scaleC32
	case hal.C128:
		fn, name, k = h.st.b.zgeam, "cublasZgeam", scaleC64
	default:
		return fmt.Errorf("cublas: Geam: dtype %v is not supported; use f32, f64, c64 or c128", d.Type)
	}
	ta, err := op(d.TransA)
	if err != nil {
		return fmt.Errorf("%s: TransA: %w", name, err)
	}
	tb, err := op(d.TransB)
	if err != nil {
		return fmt.Errorf("%s: TransB: %w", name, err)
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
	h.alpha.set(k, d.Alpha)
	h.beta.set(k, d.Beta)
	return h.call(name, func() int32 {
		return fn(h.h, ta, tb, m, n, h.alpha.ptr(), uintptr(d.A), lda, h.beta.ptr(), uintptr(d.B), ldb, uintptr(d.C), ldc)
	})
}

// GroupedNative reports whether GemmGrouped uses cublasGemmGroupedBatchedEx
// (cuBLAS >= 12.5 and the CUDA driver loaded). Even then, dtype pairs the
// grouped call does not support (mixed A/B and C types, complex) run as a loop
// of cublasGemmEx. Safe to call at any time.
func (h *handle) GroupedNative() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.native
}

// Destroy waits for the handle's staged grouped-GEMM pointer arrays to be
// consumed, frees them, and destroys the cuBLAS handle (cublasDestroy_v2, which
// synchronises the device). A second Destroy returns nil; every other call
// after Destroy returns an error wrapping hal.ErrClosed.
func (h *handle) Destroy() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.destroyed {
		return nil
	}
	h.destroyed = true
	err := h.r.Do(func() error {
		e1 := h.scr.free(&h.st.d)
		e2 := h.st.b.statusError("cublasDestroy_v2", h.st.b.destroy(h.h))
		return errors.Join(e1, e2)
	})
	return errors.Join(err, h.st.release())
}
