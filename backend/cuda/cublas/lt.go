package cublas

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// ltKey identifies a cached matmul plan: everything that goes into the
// descriptors and the heuristic query.
type ltKey struct {
	ta, tb        hal.Op
	m, n, k       int
	lda, ldb, ldc int
	ab, c         hal.DType
	ws            int
}

// ltPlan is the cached descriptors and heuristic algorithm for one ltKey.
type ltPlan struct {
	desc, a, b, c uintptr // matmul descriptor and A, B, C (= D) layouts
	algo          [8]uint64
}

// ltMaxPlans bounds the plan cache; when full it is emptied (shapes that vary
// per batch, such as token counts, would otherwise grow it without end).
const ltMaxPlans = 1024

// ltHandle is a cuBLASLt handle (hal.LtHandle).
type ltHandle struct {
	mu          sync.Mutex // guards everything below; held across each call
	st          *state
	r           hal.Runner
	h           uintptr // cublasLtHandle_t
	plans       map[ltKey]*ltPlan
	destroyed   bool
	alpha, beta scalar
}

// ltTypes returns the cudaDataType_t of A/B and C for a supported Lt matmul:
// AB in {f32, f16, bf16} with C equal to AB or f32, f32 compute and scale.
func ltTypes(ab, c hal.DType) (abT, cT int32, err error) {
	switch ab {
	case hal.F32, hal.F16, hal.BF16:
		if c == ab || c == hal.F32 {
			abT, _ = dataType(ab)
			cT, _ = dataType(c)
			return abT, cT, nil
		}
	}
	return 0, 0, fmt.Errorf("cublasLtMatmul: A/B %v with C %v is not supported; use f32, f16 or bf16 A/B with C of the same type or f32", ab, c)
}

// ltLayoutDims returns rows and columns of the stored (untransposed) matrix
// whose op is rows×cols when not transposed.
func ltLayoutDims(o hal.Op, rows, cols int) (uint64, uint64) {
	if o == hal.Trans {
		return uint64(cols), uint64(rows)
	}
	return uint64(rows), uint64(cols)
}

// Matmul queues D = C = alpha*op(A)*op(B) + beta*C (cublasLtMatmul) on s with
// [ws, ws+wsSize) as workspace and returns without waiting. The workspace must
// not be used by another stream until this matmul completes. The first call
// for a shape builds descriptors and runs the heuristic (host work only); later
// calls reuse them.
func (h *ltHandle) Matmul(s hal.Stream, d hal.GemmDesc, ws hal.Ptr, wsSize int) error {
	const call = "cublasLtMatmul"
	stream, err := rawStream(call, s)
	if err != nil {
		return err
	}
	if wsSize < 0 || (wsSize > 0 && ws == 0) {
		return fmt.Errorf("%s: workspace %#x of %d bytes is invalid; pass a device buffer and its size, or 0 and 0", call, uintptr(ws), wsSize)
	}
	abT, cT, err := ltTypes(d.AB, d.CType)
	if err != nil {
		return err
	}
	if _, err := convertGemm(call, d, false); err != nil { // enums and ranges
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.destroyed {
		return fmt.Errorf("cublas: Matmul on a destroyed Lt handle: %w", hal.ErrClosed)
	}
	key := ltKey{ta: d.TransA, tb: d.TransB, m: d.M, n: d.N, k: d.K, lda: d.LDA, ldb: d.LDB, ldc: d.LDC, ab: d.AB, c: d.CType, ws: wsSize}
	h.alpha.set(scaleF32, complex(d.Alpha, 0))
	h.beta.set(scaleF32, complex(d.Beta, 0))
	return h.r.Do(func() error {
		p := h.plans[key]
		if p == nil {
			if len(h.plans) >= ltMaxPlans {
				if err := h.dropPlans(); err != nil {
					return err
				}
			}
			var err error
			if p, err = h.newPlan(key, abT, cT); err != nil {
				return err
			}
			h.plans[key] = p
		}
		return h.st.b.statusError(call, h.st.l.matmul(h.h, p.desc,
			h.alpha.ptr(), uintptr(d.A), p.a, uintptr(d.B), p.b,
			h.beta.ptr(), uintptr(d.C), p.c, uintptr(d.C), p.c,
			&p.algo, uintptr(ws), uint64(wsSize), stream))
	})
}

// newPlan creates the descriptors for k and asks the heuristic for the best
// algorithm within k.ws bytes of workspace. It runs inside the runner.
func (h *ltHandle) newPlan(k ltKey, abT, cT int32) (*ltPlan, error) {
	p := &ltPlan{}
	if err := h.fillPlan(p, k, abT, cT); err != nil {
		return nil, errors.Join(err, h.destroyPlan(p))
	}
	return p, nil
}

// fillPlan creates p's descriptors and runs the heuristic; on error p holds
// whatever was created so far.
func (h *ltHandle) fillPlan(p *ltPlan, k ltKey, abT, cT int32) error {
	l, chk := &h.st.l, h.st.b.statusError
	if err := chk("cublasLtMatmulDescCreate", l.descCreate(&p.desc, computeF32, cudaR32F)); err != nil {
		return err
	}
	for _, a := range []struct {
		attr int32
		o    hal.Op
	}{{ltDescTransA, k.ta}, {ltDescTransB, k.tb}} {
		v, err := op(a.o)
		if err != nil {
			return err
		}
		if err := chk("cublasLtMatmulDescSetAttribute", l.descSetAttribute(p.desc, a.attr, unsafe.Pointer(&v), 4)); err != nil {
			return err
		}
	}
	ar, ac := ltLayoutDims(k.ta, k.m, k.k)
	br, bc := ltLayoutDims(k.tb, k.k, k.n)
	for _, lay := range []struct {
		dst        *uintptr
		typ        int32
		rows, cols uint64
		ld         int
	}{{&p.a, abT, ar, ac, k.lda}, {&p.b, abT, br, bc, k.ldb}, {&p.c, cT, uint64(k.m), uint64(k.n), k.ldc}} {
		if err := chk("cublasLtMatrixLayoutCreate", l.layoutCreate(lay.dst, lay.typ, lay.rows, lay.cols, int64(lay.ld))); err != nil {
			return err
		}
	}
	var pref uintptr
	if err := chk("cublasLtMatmulPreferenceCreate", l.prefCreate(&pref)); err != nil {
		return err
	}
	defer l.prefDestroy(pref)
	wsBytes := uint64(k.ws)
	if err := chk("cublasLtMatmulPreferenceSetAttribute", l.prefSetAttribute(pref, ltPrefMaxWorkspce, unsafe.Pointer(&wsBytes), 8)); err != nil {
		return err
	}
	var res ltHeuristicResult
	var n int32
	if err := chk("cublasLtMatmulAlgoGetHeuristic", l.algoGetHeuristic(h.h, p.desc, p.a, p.b, p.c, p.c, pref, 1, &res, &n)); err != nil {
		return err
	}
	if n < 1 {
		return fmt.Errorf("cublasLtMatmulAlgoGetHeuristic: no algorithm for %dx%dx%d %v->%v (trans %d,%d) within %d bytes of workspace; give a larger workspace or use the cuBLAS handle",
			k.m, k.n, k.k, k.ab, k.c, k.ta, k.tb, k.ws)
	}
	p.algo = res.algo
	return nil
}

// destroyPlan destroys whatever descriptors p holds.
func (h *ltHandle) destroyPlan(p *ltPlan) error {
	l, chk := &h.st.l, h.st.b.statusError
	var errs []error
	for _, x := range []uintptr{p.a, p.b, p.c} {
		if x != 0 {
			errs = append(errs, chk("cublasLtMatrixLayoutDestroy", l.layoutDestroy(x)))
		}
	}
	if p.desc != 0 {
		errs = append(errs, chk("cublasLtMatmulDescDestroy", l.descDestroy(p.desc)))
	}
	*p = ltPlan{}
	return errors.Join(errs...)
}

// dropPlans destroys every cached plan. Descriptors are host objects: matmuls
// already queued with them do not need them any more.
func (h *ltHandle) dropPlans() error {
	var errs []error
	for k, p := range h.plans {
		errs = append(errs, h.destroyPlan(p))
		delete(h.plans, k)
	}
	return errors.Join(errs...)
}

// Destroy releases the cached plans and the cuBLASLt handle
// (cublasLtDestroy). A second Destroy returns nil; Matmul after Destroy returns
// an error wrapping hal.ErrClosed.
func (h *ltHandle) Destroy() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.destroyed {
		return nil
	}
	h.destroyed = true
	err := h.r.Do(func() error {
		return errors.Join(h.dropPlans(), h.st.b.statusError("cublasLtDestroy", h.st.l.destroy(h.h)))
	})
	return errors.Join(err, h.st.release())
}
