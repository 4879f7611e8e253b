package cpu

import (
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"unsafe"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"

	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// ErrHandleMisuse is wrapped by the error of a library handle call that
// breaks the handle's contract: a handle entered by two calls at once, used
// for a stream other than the one it is bound to, or a GEMM queued after
// SetStream dropped the workspace and before SetWorkspace set it again. A real
// cuBLAS or cuBLASLt handle would corrupt results silently; the CPU backend
// refuses the call, so that every such bug fails the test that makes it.
var ErrHandleMisuse = errors.New("library handle contract broken")

// Hooks are test hooks for the library handles of one CPU device (SetHooks).
type Hooks struct {
	// Inside runs in every BLAS and cuBLASLt handle call (call names it, e.g.
	// "BlasHandle.Gemm", "LtHandle.Matmul") while the call holds the handle:
	// a test may block in it to keep the handle busy.
	Inside func(call string)
	// Misuse runs with the error of every call refused with ErrHandleMisuse.
	Misuse func(err error)
}

// callChecks is a device's record of handle contract violations and its hooks.
type callChecks struct {
	hooks    atomic.Pointer[Hooks]
	misuses  atomic.Int64
	firstErr atomic.Pointer[error]
}

// SetHooks installs h on d, which must be a device of this backend, for
// every handle of d (those made earlier included), and returns the hooks it
// replaces. Tests only: the hooks run on the callers' goroutines.
func SetHooks(d hal.Device, h Hooks) (Hooks, error) {
	cd, ok := d.(*device)
	if !ok {
		return Hooks{}, fmt.Errorf("cpu: SetHooks: device %T is not a CPU device: %w", d, hal.ErrInvalid)
	}
	if old := cd.calls.hooks.Swap(&h); old != nil {
		return *old, nil
	}
	return Hooks{}, nil
}

// Misuses returns how many handle calls d, a device of this backend, refused
// with ErrHandleMisuse since it was opened, and the first such error (nil:
// none). It is -1 for a device of another backend.
func Misuses(d hal.Device) (int64, error) {
	cd, ok := d.(*device)
	if !ok {
		return -1, nil
	}
	var first error
	if p := cd.calls.firstErr.Load(); p != nil {
		first = *p
	}
	return cd.calls.misuses.Load(), first
}

// misuse records err (which wraps ErrHandleMisuse), runs the Misuse hook and
// returns err.
func (c *callChecks) misuse(err error) error {
	c.misuses.Add(1)
	c.firstErr.CompareAndSwap(nil, &err)
	if h := c.hooks.Load(); h != nil && h.Misuse != nil {
		h.Misuse(err)
	}
	return err
}

// guard detects a handle entered by two calls at once. It uses no lock and no
// timing: a call marks the handle busy for its whole duration, and a call that
// finds it busy is refused. cuBLAS and cuBLASLt handles are not safe for
// concurrent use; the caller (package gpuctx) must serialise every call.
type guard struct{ busy atomic.Bool }

// handleCore is what the BLAS and cuBLASLt handles share: the busy guard, the
// device, the kind's name for messages and whether it is destroyed.
type handleCore struct {
	guard
	dev       *device
	kind      string // "BlasHandle" or "LtHandle"
	destroyed bool
}

// begin enters the handle for call and checks that it is not destroyed; the
// caller must call exit when the call is done.
func (h *handleCore) begin(call string) (exit func(), err error) {
	if exit, err = h.enter(&h.dev.calls, h.kind+"."+call); err != nil {
		return nil, err
	}
	if h.destroyed {
		exit()
		return nil, fmt.Errorf("cpu: %s.%s: handle is destroyed (create a new one): %w", h.kind, call, hal.ErrClosed)
	}
	return exit, nil
}

// ownStream returns s as a stream of the handle's device, or an error naming
// call.
func (h *handleCore) ownStream(call string, s hal.Stream) (*stream, error) {
	st, ok := s.(*stream)
	if !ok || st == nil || st.dev != h.dev {
		return nil, fmt.Errorf("cpu: %s.%s: stream %v does not come from this device's NewStream", h.kind, call, s)
	}
	return st, nil
}

// enter marks the handle busy for call and runs the Inside hook; the caller
// must call the returned func when the call is done.
func (g *guard) enter(c *callChecks, call string) (exit func(), err error) {
	if !g.busy.CompareAndSwap(false, true) {
		return nil, c.misuse(fmt.Errorf("cpu: %s: the handle is in use by another call (two goroutines entered it at once; a real handle would corrupt its state): %w", call, ErrHandleMisuse))
	}
	if h := c.hooks.Load(); h != nil && h.Inside != nil {
		h.Inside(call)
	}
	return g.leave, nil
}

func (g *guard) leave() { g.busy.Store(false) }

// blasHandle mirrors a cuBLAS handle. Like cuBLAS it has no lock, but it
// refuses (ErrHandleMisuse) a call that enters it while another is inside, a
// CheckStream for a stream it is not bound to, and a GEMM after SetStream
// dropped its workspace and before SetWorkspace set one again.
type blasHandle struct {
	handleCore
	stream *stream
	ws     hal.Ptr
	wsSize int
	// wsDropped: SetStream reset a user workspace to the library default (as
	// cublasSetStream does) and SetWorkspace has not been called since.
	wsDropped bool
	math      hal.MathMode
}

// NewBlasHandle creates a BLAS handle bound to no stream; call SetStream before
// any operation. Safe for concurrent use; the handle itself is not.
func (d *device) NewBlasHandle() (hal.BlasHandle, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return nil, d.errClosed("NewBlasHandle")
	}
	return &blasHandle{handleCore: handleCore{dev: d, kind: "BlasHandle"}}, nil
}

// SetStream binds the handle to s: later operations queue on s. Like
// cublasSetStream it resets the workspace to the library default (none here):
// call SetWorkspace right after, or the next GEMM is refused.
func (h *blasHandle) SetStream(s hal.Stream) error {
	exit, err := h.begin("SetStream")
	if err != nil {
		return err
	}
	defer exit()
	st, err := h.ownStream("SetStream", s)
	if err != nil {
		return err
	}
	h.stream = st
	h.wsDropped = h.wsDropped || h.ws != 0
	h.ws, h.wsSize = 0, 0
	return nil
}

// CheckStream reports an error wrapping ErrHandleMisuse when the handle is
// not bound to s, the stream its caller is about to queue work for. The
// caller (package gpuctx) calls it before every operation through a lent
// handle; a real cuBLAS handle cannot tell and would queue on its own stream.
func (h *blasHandle) CheckStream(s hal.Stream) error {
	exit, err := h.begin("CheckStream")
	if err != nil {
		return err
	}
	defer exit()
	if st, ok := s.(*stream); !ok || st != h.stream {
		return h.dev.calls.misuse(fmt.Errorf("cpu: BlasHandle.CheckStream: the handle is bound to stream %s but used for stream %s (a real handle would queue the work on the wrong stream): %w",
			streamName(h.stream), streamName(s), ErrHandleMisuse))
	}
	return nil
}

// streamName names s for an error message: "7", or "none".
func streamName(s hal.Stream) string {
	if st, ok := s.(*stream); ok && st != nil {
		return fmt.Sprint(st.id)
	}
	return "none"
}

// BoundStream returns the stream the handle is bound to (nil: none), as the
// library holds it (hal.BlasInspector).
func (h *blasHandle) BoundStream() hal.Stream {
	if h.stream == nil {
		return nil
	}
	return h.stream
}

// BoundWorkspace returns the workspace the handle holds ((0, 0): the library
// default, which SetStream restores, as cublasSetStream does).
func (h *blasHandle) BoundWorkspace() (hal.Ptr, int) { return h.ws, h.wsSize }

// SetWorkspace makes [p, p+n) the handle's workspace; it must lie inside one
// live allocation and p must be 256-byte aligned (as cuBLAS requires). p == 0
// with n == 0 removes the workspace. Operations read it when they are queued.
func (h *blasHandle) SetWorkspace(p hal.Ptr, n int) error {
	exit, err := h.begin("SetWorkspace")
	if err != nil {
		return err
	}
	defer exit()
	if p == 0 && n == 0 {
		h.ws, h.wsSize, h.wsDropped = 0, 0, false
		return nil
	}
	if n <= 0 {
		return fmt.Errorf("cpu: BlasHandle.SetWorkspace(%#x, %d): size must be positive (or pass 0, 0 for none)", uintptr(p), n)
	}
	if _, err := h.dev.mem("BlasHandle.SetWorkspace", p, n, 256); err != nil {
		return err
	}
	h.ws, h.wsSize, h.wsDropped = p, n, false
	return nil
}

// SetMathMode records the math mode; MathTF32 makes f32 GEMMs round their
// inputs to TF32 (10-bit mantissa), as tensor cores do.
func (h *blasHandle) SetMathMode(m hal.MathMode) error {
	exit, err := h.begin("SetMathMode")
	if err != nil {
		return err
	}
	defer exit()
	switch m {
	case hal.MathDefault, hal.MathTensorOp, hal.MathTF32:
		h.math = m
		return nil
	}
	return fmt.Errorf("cpu: BlasHandle.SetMathMode(%d): unknown math mode", m)
}

// op enters the handle for an operation and returns its bound stream. It
// fails when the handle has no stream, and with ErrHandleMisuse when
// SetStream dropped the workspace and SetWorkspace has not set it again (on
// cuBLAS the operation would run on the library's default workspace, which
// every stream shares).
func (h *blasHandle) op(call string) (*stream, func(), error) {
	exit, err := h.begin(call)
	if err != nil {
		return nil, nil, err
	}
	if h.stream == nil {
		exit()
		return nil, nil, fmt.Errorf("cpu: BlasHandle.%s: handle is bound to no stream; call SetStream first", call)
	}
	if h.wsDropped {
		exit()
		return nil, nil, h.dev.calls.misuse(fmt.Errorf("cpu: BlasHandle.%s: SetStream reset the workspace to the library default and SetWorkspace was not called again (cuBLAS would use its default workspace, shared by every stream): %w", call, ErrHandleMisuse))
	}
	return h.stream, exit, nil
}

// Gemm queues C = alpha*op(A)*op(B) + beta*C on the bound stream.
func (h *blasHandle) Gemm(g hal.GemmDesc) error {
	s, exit, err := h.op("Gemm")
	if err != nil {
		return err
	}
	defer exit()
	return h.dev.queueGemms("BlasHandle.Gemm", s, []hal.GemmDesc{g}, h.math, h.ws, h.wsSize)
}

// GemmStridedBatched queues b.Count GEMMs on the bound stream, matrix i at
// A + i*StrideA elements (likewise B and C).
func (h *blasHandle) GemmStridedBatched(g hal.GemmDesc, b hal.StridedBatch) error {
	s, exit, err := h.op("GemmStridedBatched")
	if err != nil {
		return err
	}
	defer exit()
	if b.Count < 0 {
		return fmt.Errorf("cpu: BlasHandle.GemmStridedBatched: negative batch count %d", b.Count)
	}
	ds := make([]hal.GemmDesc, b.Count)
	for i := range ds {
		ds[i] = g
		ds[i].A += hal.Ptr(int64(i) * b.StrideA * int64(g.AB.Size()))
		ds[i].B += hal.Ptr(int64(i) * b.StrideB * int64(g.AB.Size()))
		ds[i].C += hal.Ptr(int64(i) * b.StrideC * int64(g.CType.Size()))
	}
	return h.dev.queueGemms("BlasHandle.GemmStridedBatched", s, ds, h.math, h.ws, h.wsSize)
}

// GemmGrouped queues the GEMMs ds, one after the other, on the bound stream.
func (h *blasHandle) GemmGrouped(ds []hal.GemmDesc) error {
	s, exit, err := h.op("GemmGrouped")
	if err != nil {
		return err
	}
	defer exit()
	return h.dev.queueGemms("BlasHandle.GemmGrouped", s, append([]hal.GemmDesc(nil), ds...), h.math, h.ws, h.wsSize)
}

// GroupedNative reports false: GemmGrouped is a loop of GEMMs.
func (h *blasHandle) GroupedNative() bool { return false }

// Geam queues C = alpha*op(A) + beta*op(B) on the bound stream. C may be A
// (or B) when that operand is not transposed and has C's leading dimension.
func (h *blasHandle) Geam(g hal.GeamDesc) error {
	s, exit, err := h.op("Geam")
	if err != nil {
		return err
	}
	defer exit()
	if err := validateGeam(g); err != nil {
		return err
	}
	d := h.dev
	return s.enqueueFn("BlasHandle.Geam", func() error { return d.geam(g) })
}

// Destroy releases the handle; work already queued still runs.
func (h *blasHandle) Destroy() error {
	exit, err := h.begin("Destroy")
	if err != nil {
		return err
	}
	defer exit()
	h.destroyed = true
	h.stream = nil
	return nil
}

// ltHandle mirrors a cuBLASLt handle: stream and workspace come with each
// call. cuBLASLt has no stream binding; this one records the stream the
// caller bound it to (SetStream) and refuses (ErrHandleMisuse) a Matmul on any
// other, as it refuses a call that enters it while another is inside.
type ltHandle struct {
	handleCore
	bound *stream // nil: not bound; Matmul takes any stream
}

// NewLtHandle creates a cuBLASLt-style handle. Safe for concurrent use; the
// handle itself is not.
func (d *device) NewLtHandle() (hal.LtHandle, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return nil, d.errClosed("NewLtHandle")
	}
	return &ltHandle{handleCore: handleCore{dev: d, kind: "LtHandle"}}, nil
}

// SetStream records s as the stream the handle is lent for: until the next
// SetStream, Matmul and CheckStream refuse any other stream. The caller
// (package gpuctx) calls it when it binds the handle to a callback's stream.
func (h *ltHandle) SetStream(s hal.Stream) error {
	exit, err := h.begin("SetStream")
	if err != nil {
		return err
	}
	defer exit()
	st, err := h.ownStream("SetStream", s)
	if err != nil {
		return err
	}
	h.bound = st
	return nil
}

// CheckStream reports an error wrapping ErrHandleMisuse when the handle is
// bound to a stream other than s.
func (h *ltHandle) CheckStream(s hal.Stream) error {
	exit, err := h.begin("CheckStream")
	if err != nil {
		return err
	}
	defer exit()
	return h.checkBound("CheckStream", s)
}

func (h *ltHandle) checkBound(call string, s hal.Stream) error {
	if st, ok := s.(*stream); h.bound != nil && (!ok || st != h.bound) {
		return h.dev.calls.misuse(fmt.Errorf("cpu: LtHandle.%s: the handle is bound to stream %s but used for stream %s: %w",
			call, streamName(h.bound), streamName(s), ErrHandleMisuse))
	}
	return nil
}

// Matmul queues the GEMM d on s with [ws, ws+wsSize) as workspace (wsSize 0:
// none). AB must be F32, F16 or BF16 and CType AB or F32; compute is f32.
func (h *ltHandle) Matmul(s hal.Stream, g hal.GemmDesc, ws hal.Ptr, wsSize int) error {
	exit, err := h.begin("Matmul")
	if err != nil {
		return err
	}
	defer exit()
	st, err := h.ownStream("Matmul", s)
	if err != nil {
		return err
	}
	if err := h.checkBound("Matmul", s); err != nil {
		return err
	}
	if g.AB != hal.F32 && g.AB != hal.F16 && g.AB != hal.BF16 {
		return fmt.Errorf("cpu: LtHandle.Matmul: AB type %v is not supported; use f32, f16 or bf16", g.AB)
	}
	if wsSize < 0 {
		return fmt.Errorf("cpu: LtHandle.Matmul: negative workspace size %d", wsSize)
	}
	if wsSize > 0 {
		if _, err := h.dev.mem("LtHandle.Matmul workspace", ws, wsSize, 16); err != nil {
			return err
		}
	}
	return h.dev.queueGemms("LtHandle.Matmul", st, []hal.GemmDesc{g}, hal.MathDefault, ws, wsSize)
}

// Destroy releases the handle; work already queued still runs.
func (h *ltHandle) Destroy() error {
	exit, err := h.enter(&h.dev.calls, "LtHandle.Destroy")
	if err != nil {
		return err
	}
	defer exit()
	if h.destroyed {
		return fmt.Errorf("cpu: LtHandle.Destroy: handle is already destroyed: %w", hal.ErrClosed)
	}
	h.destroyed = true
	return nil
}

// dims returns the stored shape (rows, cols) of a column-major operand whose
// op() is r×c.
func dims(t hal.Op, r, c int) (int, int) {
	if t == hal.Trans {
		return c, r
	}
	return r, c
}

// extent is the number of elements a column-major rows×cols matrix spans.
func extent(rows, cols, ld int) int {
	if rows == 0 || cols == 0 {
		return 0
	}
	return (cols-1)*ld + rows
}

func validateGemm(call string, g hal.GemmDesc) error {
	ok := false
	switch g.AB {
	case hal.F32, hal.F64:
		ok = g.CType == g.AB
	case hal.F16, hal.BF16:
		ok = g.CType == g.AB || g.CType == hal.F32
	}
	if !ok {
		return fmt.Errorf("cpu: %s: types AB=%v C=%v are not supported; use f32/f32, f64/f64, or f16/bf16 with C the same or f32", call, g.AB, g.CType)
	}
	if g.TransA != hal.NoTrans && g.TransA != hal.Trans || g.TransB != hal.NoTrans && g.TransB != hal.Trans {
		return fmt.Errorf("cpu: %s: bad transpose flags %d, %d", call, g.TransA, g.TransB)
	}
	if g.M < 0 || g.N < 0 || g.K < 0 {
		return fmt.Errorf("cpu: %s: negative shape m=%d n=%d k=%d", call, g.M, g.N, g.K)
	}
	ra, _ := dims(g.TransA, g.M, g.K)
	rb, _ := dims(g.TransB, g.K, g.N)
	for _, l := range []struct {
		name     string
		ld, rows int
	}{{"lda", g.LDA, ra}, {"ldb", g.LDB, rb}, {"ldc", g.LDC, g.M}} {
		if l.ld < max(1, l.rows) {
			return fmt.Errorf("cpu: %s: %s=%d is less than max(1, %d rows)", call, l.name, l.ld, l.rows)
		}
	}
	return nil
}

// queueGemms validates ds and queues them as one operation on s. While it runs
// the operation holds the workspace (conflict detection), reads it when it
// computes split-K, and fails with a sticky error if any range is not live.
func (d *device) queueGemms(call string, s *stream, ds []hal.GemmDesc, mode hal.MathMode, ws hal.Ptr, wsSize int) error {
	for i, g := range ds {
		if err := validateGemm(fmt.Sprintf("%s[%d]", call, i), g); err != nil {
			return err
		}
	}
	tf32 := mode == hal.MathTF32
	return s.enqueueFn(call, func() error {
		var wsBuf []byte
		if wsSize > 0 {
			release := d.acquireWorkspace(ws, s.id)
			defer release()
			if d.wsHook != nil {
				d.wsHook()
			}
			var err error
			if wsBuf, err = d.mem(call+" workspace", ws, wsSize, 8); err != nil {
				return err
			}
		}
		for i, g := range ds {
			if err := d.gemm(g, tf32, wsBuf); err != nil {
				return fmt.Errorf("%s[%d]: %w", call, i, err)
			}
		}
		return nil
	})
}

// splitCount is the number of K slices a GEMM is split into given the
// workspace bytes available (1: no split-K).
func splitCount(m, n, k, wsBytes, elemSize int) int {
	if k < 1024 || k < 8*max(m, n) {
		return 1
	}
	for s := 4; s >= 2; s /= 2 {
		if wsBytes >= s*m*n*elemSize {
			return s
		}
	}
	return 1
}

// gemm computes one GEMM; it runs on a stream goroutine.
func (d *device) gemm(g hal.GemmDesc, tf32 bool, ws []byte) error {
	if g.AB == hal.F64 {
		return gemmT(d, g, false, ws, gonum.Implementation{}.Dgemm)
	}
	return gemmT(d, g, tf32 && g.AB == hal.F32, ws, gonum.Implementation{}.Sgemm)
}

type gemmFunc[T float32 | float64] func(tA, tB blas.Transpose, m, n, k int, alpha T, a []T, lda int, b []T, ldb int, beta T, c []T, ldc int)

func blasOp(t hal.Op) blas.Transpose {
	if t == hal.Trans {
		return blas.Trans
	}
	return blas.NoTrans
}

// gemmT computes a column-major GEMM with row-major gonum by computing
// Cᵀ = op(B)ᵀ op(A)ᵀ: B's memory read row-major is Bᵀ, and likewise A and C.
func gemmT[T float32 | float64](d *device, g hal.GemmDesc, tf32 bool, ws []byte, f gemmFunc[T]) error {
	m, n, k := g.M, g.N, g.K
	if m == 0 || n == 0 {
		return nil
	}
	cb, err := d.mem("C", g.C, extent(m, n, g.LDC)*g.CType.Size(), g.CType.Size())
	if err != nil {
		return err
	}
	c := make([]T, m*n) // packed column-major, ld = m
	if g.Beta != 0 {
		get := reader(cb, g.CType)
		for j := range n {
			for i := range m {
				c[i+j*m] = T(get(i + j*g.LDC))
			}
		}
	}
	alpha, beta := T(g.Alpha), T(g.Beta)
	if k == 0 || g.Alpha == 0 {
		for i := range c {
			c[i] *= beta
		}
	} else {
		ra, ca := dims(g.TransA, m, k)
		rb, cbols := dims(g.TransB, k, n)
		a, err := loadMatrix[T](d, "A", g.A, g.AB, extent(ra, ca, g.LDA), tf32)
		if err != nil {
			return err
		}
		b, err := loadMatrix[T](d, "B", g.B, g.AB, extent(rb, cbols, g.LDB), tf32)
		if err != nil {
			return err
		}
		tA, tB := blasOp(g.TransB), blasOp(g.TransA)
		var zero T
		esz := int(unsafe.Sizeof(zero))
		if splits := splitCount(m, n, k, len(ws), esz); splits > 1 {
			d.splitKOps.Add(1)
			part := make([]T, m*n)
			kc := (k + splits - 1) / splits
			for s := range splits {
				k0, k1 := s*kc, min(k, (s+1)*kc)
				offA, offB := k0*g.LDA, k0 // op(A)[:, k0:k1] and op(B)[k0:k1, :]
				if g.TransA == hal.Trans {
					offA = k0
				}
				if g.TransB == hal.Trans {
					offB = k0 * g.LDB
				}
				f(tA, tB, n, m, k1-k0, 1, b[offB:], g.LDB, a[offA:], g.LDA, 0, part, m)
				wsStore(ws, s*m*n, part)
			}
			// Reduce the partial products from the workspace, as a split-K
			// GEMM's second kernel does; another stream writing the same
			// workspace meanwhile corrupts the result.
			sum := make([]T, m*n)
			for s := range splits {
				wsAdd(ws, s*m*n, sum)
			}
			for i := range c {
				c[i] = alpha*sum[i] + beta*c[i]
			}
		} else {
			f(tA, tB, n, m, k, alpha, b, g.LDB, a, g.LDA, beta, c, m)
		}
	}
	put := writer(cb, g.CType)
	for j := range n {
		for i := range m {
			put(i+j*g.LDC, float64(c[i+j*m]))
		}
	}
	return nil
}

// loadMatrix reads n elements of dtype dt at p into a new []T, rounding f32
// values to TF32 when tf32 is set.
func loadMatrix[T float32 | float64](d *device, what string, p hal.Ptr, dt hal.DType, n int, tf32 bool) ([]T, error) {
	b, err := d.mem(what, p, n*dt.Size(), dt.Size())
	if err != nil {
		return nil, err
	}
	out := make([]T, n)
	if dt == hal.F32 && tf32 {
		src := view[float32](b)
		for i := range out {
			out[i] = T(roundTF32(src[i]))
		}
		return out, nil
	}
	get := reader(b, dt)
	for i := range out {
		out[i] = T(get(i))
	}
	return out, nil
}

// view reinterprets b as []T; b's start must be aligned for T.
func view[T any](b []byte) []T {
	var zero T
	if len(b) == 0 {
		return nil
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/int(unsafe.Sizeof(zero)))
}

// reader returns a function reading element i of b (dtype dt) exactly as float64.
func reader(b []byte, dt hal.DType) func(i int) float64 {
	switch dt {
	case hal.F32:
		v := view[float32](b)
		return func(i int) float64 { return float64(v[i]) }
	case hal.F64:
		v := view[float64](b)
		return func(i int) float64 { return v[i] }
	case hal.F16:
		v := view[uint16](b)
		return func(i int) float64 { return float64(half.FromF16(v[i])) }
	case hal.BF16:
		v := view[uint16](b)
		return func(i int) float64 { return float64(bf16ToF32(v[i])) }
	}
	panic("cpu: reader: unsupported dtype " + dt.String()) // validateGemm excludes it
}

// writer returns a function storing v as element i of b (dtype dt), rounding
// to nearest even.
func writer(b []byte, dt hal.DType) func(i int, v float64) {
	switch dt {
	case hal.F32:
		o := view[float32](b)
		return func(i int, v float64) { o[i] = float32(v) }
	case hal.F64:
		o := view[float64](b)
		return func(i int, v float64) { o[i] = v }
	case hal.F16:
		o := view[uint16](b)
		return func(i int, v float64) { o[i] = half.F16(float32(v)) }
	case hal.BF16:
		o := view[uint16](b)
		return func(i int, v float64) { o[i] = f32ToBF16(float32(v)) }
	}
	panic("cpu: writer: unsupported dtype " + dt.String())
}

func bf16ToF32(h uint16) float32 { return half.FromBF16(h) }

// f32ToBF16 rounds to the nearest bfloat16, ties to even (package half).
func f32ToBF16(f float32) uint16 { return half.BF16(f) }

// roundTF32 rounds f to TF32 precision (10 explicit mantissa bits), to nearest
// even, as tensor cores do with f32 inputs in TF32 mode.
func roundTF32(f float32) float32 {
	b := math.Float32bits(f)
	if b&0x7f800000 == 0x7f800000 {
		return f
	}
	b += 0xfff + (b>>13)&1
	return math.Float32frombits(b &^ 0x1fff)
}

// wsStore writes v into the workspace starting at element off, atomically per
// element (the workspace may be shared by another stream by mistake; the
// conflict counter reports that, the race detector need not).
func wsStore[T float32 | float64](ws []byte, off int, v []T) {
	switch v := any(v).(type) {
	case []float32:
		u := view[uint32](ws)[off : off+len(v)]
		for i, x := range v {
			atomic.StoreUint32(&u[i], math.Float32bits(x))
		}
	case []float64:
		u := view[uint64](ws)[off : off+len(v)]
		for i, x := range v {
			atomic.StoreUint64(&u[i], math.Float64bits(x))
		}
	}
}

// wsAdd adds the workspace elements [off, off+len(sum)) into sum.
func wsAdd[T float32 | float64](ws []byte, off int, sum []T) {
	switch sum := any(sum).(type) {
	case []float32:
		u := view[uint32](ws)[off : off+len(sum)]
		for i := range sum {
			sum[i] += math.Float32frombits(atomic.LoadUint32(&u[i]))
		}
	case []float64:
		u := view[uint64](ws)[off : off+len(sum)]
		for i := range sum {
			sum[i] += math.Float64frombits(atomic.LoadUint64(&u[i]))
		}
	}
}

func validateGeam(g hal.GeamDesc) error {
	switch g.Type {
	case hal.F32, hal.F64, hal.C64, hal.C128:
	default:
		return fmt.Errorf("cpu: BlasHandle.Geam: type %v is not supported; use f32, f64, c64 or c128", g.Type)
	}
	if g.TransA != hal.NoTrans && g.TransA != hal.Trans || g.TransB != hal.NoTrans && g.TransB != hal.Trans {
		return fmt.Errorf("cpu: BlasHandle.Geam: bad transpose flags %d, %d", g.TransA, g.TransB)
	}
	if g.M < 0 || g.N < 0 {
		return fmt.Errorf("cpu: BlasHandle.Geam: negative shape m=%d n=%d", g.M, g.N)
	}
	ra, _ := dims(g.TransA, g.M, g.N)
	rb, _ := dims(g.TransB, g.M, g.N)
	for _, l := range []struct {
		name     string
		ld, rows int
	}{{"lda", g.LDA, ra}, {"ldb", g.LDB, rb}, {"ldc", g.LDC, g.M}} {
		if l.ld < max(1, l.rows) {
			return fmt.Errorf("cpu: BlasHandle.Geam: %s=%d is less than max(1, %d rows)", l.name, l.ld, l.rows)
		}
	}
	return nil
}

// geam computes one Geam; it runs on a stream goroutine.
func (d *device) geam(g hal.GeamDesc) error {
	switch g.Type {
	case hal.F32:
		return geamT(d, g, float32(real(g.Alpha)), float32(real(g.Beta)))
	case hal.F64:
		return geamT(d, g, real(g.Alpha), real(g.Beta))
	case hal.C64:
		return geamT(d, g, complex64(g.Alpha), complex64(g.Beta))
	default:
		return geamT(d, g, g.Alpha, g.Beta)
	}
}

func geamT[T float32 | float64 | complex64 | complex128](d *device, g hal.GeamDesc, alpha, beta T) error {
	m, n := g.M, g.N
	if m == 0 || n == 0 {
		return nil
	}
	// operand reads op(X) into a packed m×n matrix scaled by s; X is not read
	// when s is 0 (as cuBLAS, which allows a nil operand then).
	operand := func(what string, p hal.Ptr, t hal.Op, ld int, s T) ([]T, error) {
		out := make([]T, m*n)
		if s == 0 {
			return out, nil
		}
		r, c := dims(t, m, n)
		x, err := deviceSlice[T](d, what, p, int64(extent(r, c, ld)))
		if err != nil {
			return nil, err
		}
		for j := range n {
			for i := range m {
				if t == hal.Trans {
					out[i+j*m] = s * x[j+i*ld]
				} else {
					out[i+j*m] = s * x[i+j*ld]
				}
			}
		}
		return out, nil
	}
	a, err := operand("A", g.A, g.TransA, g.LDA, alpha)
	if err != nil {
		return err
	}
	b, err := operand("B", g.B, g.TransB, g.LDB, beta)
	if err != nil {
		return err
	}
	c, err := deviceSlice[T](d, "C", g.C, int64(extent(m, n, g.LDC)))
	if err != nil {
		return err
	}
	for j := range n {
		for i := range m {
			c[i+j*g.LDC] = a[i+j*m] + b[i+j*m]
		}
	}
	return nil
}

var (
	_ hal.BlasHandle = (*blasHandle)(nil)
	_ hal.LtHandle   = (*ltHandle)(nil)

	_ hal.BlasInspector = (*blasHandle)(nil)
)
