package gpuctx

import (
	"fmt"
	"math"
	"runtime"
	"sync/atomic"

	"github.com/gpuctx/gpuctx/internal/blas"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// Layout says how matrices are laid out in memory.
type Layout int

// Matrix layouts.
const (
	// RowMajor: element (i, j) of an r×c matrix is at i*ld + j, ld >= c.
	RowMajor Layout = iota
	// ColMajor: element (i, j) is at i + j*ld, ld >= r (cuBLAS's convention).
	ColMajor
)

// String returns "row-major" or "col-major".
func (l Layout) String() string { return blas.Layout(l).String() }

// Gemm describes C = Alpha*op(A)*op(B) + Beta*C with C M×N, op(A) M×K and
// op(B) K×N. A and B hold elements of type AB, C elements of type CType.
// TransA and TransB select op(X) = Xᵀ. Leading dimensions of 0 mean packed. Supported: f32->f32, f64->f64, f16->f16|f32, bf16->bf16|f32;
// f16/bf16/f32 compute in f32 (TF32 only in the TF32 flavour of a Context that
// allows it), f64 in f64.
type Gemm struct {
	Layout         Layout
	TransA, TransB bool
	M, N, K        int
	Alpha, Beta    float64
	A, B, C        *Buffer
	LDA, LDB, LDC  int
	AB, CType      DType
}

// Geam describes C = Alpha*op(A) + Beta*op(B) with C M×N, for f32, f64, c64 and
// c128 (real types use the real parts of Alpha and Beta). TransA and TransB
// select op(X) = Xᵀ, the plain transpose, for complex types too: gpuctx passes
// CUBLAS_OP_T, never CUBLAS_OP_C, so nothing is conjugated (the CPU backend
// does the same). For a conjugate transpose, conjugate the input first.
type Geam struct {
	Layout         Layout
	TransA, TransB bool
	M, N           int
	Alpha, Beta    complex128
	A, B, C        *Buffer
	LDA, LDB, LDC  int
	Type           DType
}

// Blas is a BLAS handle lent to a callback, bound to one stream. Every method
// queues work on Stream() and returns without waiting. It is a small value that
// is valid only until the callback returns; after that every method returns
// ErrHandleExpired, even on copies. Its methods may be called from several
// goroutines inside the callback; they are serialised on the handle.
type Blas struct {
	sl  *slot
	gen uint64 // the slot's lease generation when lent
}

// lease is what a slot lends to one callback. state packs the op lock (bit 0,
// held while a call through the lent handle runs, so that calls made from
// several goroutines inside one callback are serialised) and the generation
// (the bits above, bumped when the callback returns: handles of older
// generations are expired). One word keeps the callback's fast path to a single
// atomic read-modify-write for the lease.
type lease struct {
	state atomic.Uint64
	c     *Context
	s     *Stream
}

const opLocked = 1

// gen returns the current generation.
func (l *lease) gen() uint64 { return l.state.Load() >> 1 }

// lock takes the op lock while the lease is at generation gen; it reports false,
// taking nothing, once the lease has moved on. Contention is between goroutines
// of one callback only, so it yields rather than parks.
func (l *lease) lock(gen uint64) bool {
	for waited := false; ; waited = true {
		old := l.state.Load()
		if old>>1 != gen {
			return false
		}
		if old&opLocked == 0 && l.state.CompareAndSwap(old, old|opLocked) {
			return true
		}
		if !waited && old&opLocked != 0 {
			hookOpWait()
		}
		runtime.Gosched()
	}
}

// unlock releases the op lock taken by lock.
func (l *lease) unlock() { l.state.Add(^uint64(0)) }

// advance waits for a call in flight, then moves to the next generation.
func (l *lease) advance() {
	for waited := false; ; waited = true {
		old := l.state.Load()
		if old&opLocked == 0 && l.state.CompareAndSwap(old, old+2) {
			return
		}
		if !waited && old&opLocked != 0 {
			hookOpWait()
		}
		runtime.Gosched()
	}
}

// Stream returns the stream this handle's work is queued on (nil once expired).
func (h Blas) Stream() *Stream {
	if h.sl == nil || !h.sl.Handle.lease.lock(h.gen) {
		return nil
	}
	defer h.sl.Handle.lease.unlock()
	return h.sl.Handle.lease.s
}

// Native reports whether GemmGrouped uses the library's grouped GEMM (cuBLAS
// cublasGemmGroupedBatchedEx) rather than a loop of GEMMs.
func (h Blas) Native() bool {
	if h.sl == nil || !h.sl.Handle.lease.lock(h.gen) { // expired: the slot may be closing
		return false
	}
	defer h.sl.Handle.lease.unlock()
	return h.sl.Handle.blas != nil && h.sl.Handle.blas.GroupedNative()
}

// enter locks the lease and checks h is current; the returned func unlocks.
func enter(sl *slot, gen uint64, op string) (*lease, func(), error) {
	if sl == nil {
		return nil, nil, fmt.Errorf("gpuctx: %s: %w (zero handle)", op, ErrHandleExpired)
	}
	l := &sl.Handle.lease
	if !l.lock(gen) {
		return nil, nil, fmt.Errorf("gpuctx: %s: %w", op, ErrHandleExpired)
	}
	unlock, err := l.s.use(op)
	if err != nil {
		l.unlock()
		return nil, nil, err
	}
	if ch := sl.Handle.check; ch != nil {
		// A handle that checks the contract (the CPU backend) refuses a
		// stream it is not bound to: a handle bound to one stream and lent
		// for another fails here, where a real one would queue on the wrong.
		if err := ch.CheckStream(l.s.hs); err != nil {
			unlock()
			l.unlock()
			return nil, nil, fmt.Errorf("gpuctx: %s: %w", op, err)
		}
	}
	return l, func() { unlock(); l.unlock() }, nil
}

func elems(op, name string, b *Buffer, t DType, d *Device) (int, error) {
	if b == nil {
		return 0, fmt.Errorf("gpuctx: %s: %s is nil: %w", op, name, ErrInvalid)
	}
	if err := b.onDevice(op+" "+name, d); err != nil {
		return 0, err
	}
	if es := t.Size(); es == 0 {
		return 0, fmt.Errorf("gpuctx: %s: %s has invalid dtype %v: %w", op, name, t, ErrInvalid)
	} else if uintptr(b.ptr())%uintptr(es) != 0 {
		return 0, fmt.Errorf("gpuctx: %s: %s address %#x is not aligned to its %d-byte %v elements: %w", op, name, b.ptr(), es, t, ErrInvalid)
	} else {
		return b.size / es, nil
	}
}

// operand is one user operand as the backend will use it: from p on, span
// elements of es bytes.
type operand struct {
	name string // the user's name for it: A, B or C
	buf  *Buffer
	p    hal.Ptr
	span int
	es   int
}

// checkExtents checks, after the row-major mapping, that every operand the
// backend will touch lies inside the user's buffer, so that no BLAS call can
// read or write outside one. The error names the user's operand, the bytes
// needed and the bytes held.
func checkExtents(op, detail string, ops ...operand) error {
	for _, o := range ops {
		if o.span == 0 {
			continue
		}
		needB := blas.Bytes(o.span, o.es)
		base := o.buf.ptr()
		if o.p < base || uint64(o.p-base) > uint64(o.buf.size) || needB > o.buf.size-int(o.p-base) {
			return fmt.Errorf("gpuctx: %s: %s needs %d bytes%s but its buffer holds %d: %w (%w)",
				op, o.name, needB, detail, o.buf.size, ErrSize, ErrInvalid)
		}
	}
	return nil
}

// gemmDesc validates g (as a batch of count GEMMs with the given strides, in
// elements of the user's A, B and C; count 1 for a single GEMM) and returns the
// column-major descriptor and batch a backend executes. Every operand's extent
// is checked against its buffer after the mapping.
func gemmDesc(d *Device, op string, g *Gemm, count, strideA, strideB, strideC int) (hal.GemmDesc, hal.StridedBatch, error) {
	var err error
	sh := blas.GemmShape{Layout: blas.Layout(g.Layout), TransA: g.TransA, TransB: g.TransB, M: g.M, N: g.N, K: g.K,
		LDA: g.LDA, LDB: g.LDB, LDC: g.LDC, AB: hal.DType(g.AB), C: hal.DType(g.CType)}
	if sh.ALen, err = elems(op, "A", g.A, g.AB, d); err != nil {
		return hal.GemmDesc{}, hal.StridedBatch{}, err
	}
	if sh.BLen, err = elems(op, "B", g.B, g.AB, d); err != nil {
		return hal.GemmDesc{}, hal.StridedBatch{}, err
	}
	if sh.CLen, err = elems(op, "C", g.C, g.CType, d); err != nil {
		return hal.GemmDesc{}, hal.StridedBatch{}, err
	}
	if err := sh.Normalize(); err != nil {
		return hal.GemmDesc{}, hal.StridedBatch{}, fmt.Errorf("gpuctx: %s: %w", op, err)
	}
	desc := sh.ColMajorDesc(g.A.ptr(), g.B.ptr(), g.C.ptr(), g.Alpha, g.Beta)
	batch := sh.ColMajorBatch(count, strideA, strideB, strideC)
	sa, sb, sc := blas.DescSpans(desc, batch)
	if _, _, one := blas.DescSpans(desc, hal.StridedBatch{Count: 1}); count > 1 && strideC < one {
		return hal.GemmDesc{}, hal.StridedBatch{}, fmt.Errorf("gpuctx: %s: strideC=%d is smaller than the %d elements of one C matrix: the batch's outputs would overlap and the results be undefined: %w",
			op, strideC, one, ErrInvalid)
	}
	nameA, nameB := sh.DescOperands()
	bufs := map[string]*Buffer{"A": g.A, "B": g.B}
	detail := ""
	if count != 1 {
		detail = fmt.Sprintf(" for a batch of %d (strides A %d, B %d, C %d elements)", count, strideA, strideB, strideC)
	}
	if err := checkExtents(op, detail,
		operand{nameA, bufs[nameA], desc.A, sa, g.AB.Size()},
		operand{nameB, bufs[nameB], desc.B, sb, g.AB.Size()},
		operand{"C", g.C, desc.C, sc, g.CType.Size()}); err != nil {
		return hal.GemmDesc{}, hal.StridedBatch{}, err
	}
	return desc, batch, nil
}

// Gemm queues one GEMM on the handle's stream.
func (h Blas) Gemm(g Gemm) error {
	l, unlock, err := enter(h.sl, h.gen, "Blas.Gemm")
	if err != nil {
		return err
	}
	defer unlock()
	desc, _, err := gemmDesc(l.c.dev, "Blas.Gemm", &g, 1, 0, 0, 0)
	if err != nil {
		return err
	}
	if t := l.s.dev.tracer.Load(); t != nil {
		defer t.begin(l.s, blasName(l.s, "gemm"), "blas", gemmArgs(&g, 1))()
	}
	if err := h.sl.Handle.blas.Gemm(desc); err != nil {
		return fmt.Errorf("gpuctx: Blas.Gemm %dx%dx%d %v->%v: %w", g.M, g.N, g.K, g.AB, g.CType, err)
	}
	return nil
}

// GemmStridedBatched queues count GEMMs of the shape g describes; matrix i of A
// starts strideA elements after matrix i-1 (likewise B and C), in g's layout.
// g's buffers must hold every matrix of the batch.
func (h Blas) GemmStridedBatched(g Gemm, count int, strideA, strideB, strideC int) error {
	const op = "Blas.GemmStridedBatched"
	l, unlock, err := enter(h.sl, h.gen, op)
	if err != nil {
		return err
	}
	defer unlock()
	if count < 1 || count > math.MaxInt32 || strideA < 0 || strideB < 0 || strideC < 0 {
		return fmt.Errorf("gpuctx: %s: count=%d strides=(%d,%d,%d): count must be in [1, 2^31-1] (cuBLAS's batch count is an int) and strides >= 0: %w", op, count, strideA, strideB, strideC, ErrInvalid)
	}
	desc, batch, err := gemmDesc(l.c.dev, op, &g, count, strideA, strideB, strideC)
	if err != nil {
		return err
	}
	if desc.M == 0 || desc.N == 0 {
		return nil // no output: nothing to compute, whatever the count
	}
	if t := l.s.dev.tracer.Load(); t != nil {
		defer t.begin(l.s, blasName(l.s, "gemm strided batched"), "blas", gemmArgs(&g, count))()
	}
	if err := h.sl.Handle.blas.GemmStridedBatched(desc, batch); err != nil {
		return fmt.Errorf("gpuctx: %s %dx%dx%d x%d %v->%v: %w", op, g.M, g.N, g.K, count, g.AB, g.CType, err)
	}
	return nil
}

// GemmGrouped queues independent GEMMs of different shapes (one per element of
// gs) on the handle's stream: cublasGemmGroupedBatchedEx where the library has
// it, otherwise one GEMM per group, with identical results. All groups share
// dtypes, Alpha and Beta.
//
// Empty groups (M == 0 or N == 0, e.g. an expert that got no tokens) are
// skipped: nothing is read or written and no kernel runs for them. They are
// still validated, so each needs non-nil A, B and C buffers of the handle's
// device, aligned to their element size and large enough for the operand's
// shape with the other dimensions (B is K×N even when M is 0); the simplest is
// to leave them out of gs. A group with K == 0 and M, N > 0 is not empty: it
// sets C = Beta*C. An empty gs, or one whose groups are all empty, returns nil.
func (h Blas) GemmGrouped(gs []Gemm) error {
	const op = "Blas.GemmGrouped"
	l, unlock, err := enter(h.sl, h.gen, "Blas.GemmGrouped")
	if err != nil {
		return err
	}
	defer unlock()
	descs := make([]hal.GemmDesc, 0, len(gs))
	for i := range gs {
		g := &gs[i]
		if g.AB != gs[0].AB || g.CType != gs[0].CType || g.Alpha != gs[0].Alpha || g.Beta != gs[0].Beta {
			return fmt.Errorf("gpuctx: %s: group %d has dtypes %v->%v alpha %g beta %g but group 0 has %v->%v alpha %g beta %g; all groups must share them: %w",
				op, i, g.AB, g.CType, g.Alpha, g.Beta, gs[0].AB, gs[0].CType, gs[0].Alpha, gs[0].Beta, ErrInvalid)
		}
		desc, _, err := gemmDesc(l.c.dev, fmt.Sprintf("%s group %d", op, i), g, 1, 0, 0, 0)
		if err != nil {
			return err
		}
		if desc.M == 0 || desc.N == 0 {
			continue // nothing to compute (an expert with no tokens)
		}
		descs = append(descs, desc)
	}
	if len(descs) == 0 {
		return nil
	}
	if t := l.s.dev.tracer.Load(); t != nil {
		name := "gemm grouped"
		if !h.sl.Handle.blas.GroupedNative() {
			name = "gemm grouped (loop)"
		}
		args := gemmArgs(&gs[0], len(descs))
		delete(args, "m")
		delete(args, "n")
		delete(args, "k")
		defer t.begin(l.s, blasName(l.s, name), "blas", args)()
	}
	return h.sl.Handle.blas.GemmGrouped(descs)
}

// Geam queues C = Alpha*op(A) + Beta*op(B) on the handle's stream; op is the
// plain transpose when TransA or TransB is set, never the conjugate (see Geam).
func (h Blas) Geam(g Geam) error {
	const op = "Blas.Geam"
	l, unlock, err := enter(h.sl, h.gen, "Blas.Geam")
	if err != nil {
		return err
	}
	defer unlock()
	d := l.c.dev
	sh := blas.GeamShape{Layout: blas.Layout(g.Layout), TransA: g.TransA, TransB: g.TransB, M: g.M, N: g.N,
		LDA: g.LDA, LDB: g.LDB, LDC: g.LDC, Type: hal.DType(g.Type)}
	if sh.ALen, err = elems(op, "A", g.A, g.Type, d); err != nil {
		return err
	}
	if sh.BLen, err = elems(op, "B", g.B, g.Type, d); err != nil {
		return err
	}
	if sh.CLen, err = elems(op, "C", g.C, g.Type, d); err != nil {
		return err
	}
	if err := sh.Normalize(); err != nil {
		return fmt.Errorf("gpuctx: %s: %w", op, err)
	}
	desc := sh.ColMajorDesc(g.A.ptr(), g.B.ptr(), g.C.ptr(), g.Alpha, g.Beta)
	sa, sb, sc := blas.GeamDescSpans(desc)
	es := g.Type.Size()
	if err := checkExtents(op, "", operand{"A", g.A, desc.A, sa, es}, operand{"B", g.B, desc.B, sb, es}, operand{"C", g.C, desc.C, sc, es}); err != nil {
		return err
	}
	if t := l.s.dev.tracer.Load(); t != nil {
		defer t.begin(l.s, blasName(l.s, "geam"), "blas", map[string]any{"m": g.M, "n": g.N, "dtype": g.Type.String()})()
	}
	return h.sl.Handle.blas.Geam(desc)
}

// BlasLt is a cuBLASLt handle lent to a BlasLt callback. Matmul queues work on
// Stream(). Like Blas it is a value valid only until the callback returns
// (ErrHandleExpired after, copies included).
type BlasLt struct {
	sl  *slot
	gen uint64
}

// Stream returns the stream this handle's work is queued on (nil once expired).
func (lt BlasLt) Stream() *Stream { return Blas(lt).Stream() }

// Matmul queues the GEMM g on the stream with the stream's cuBLASLt workspace
// (at least the device's workspace size; Reserve grows it). Supports f32, f16
// and bf16 inputs with f32 compute.
func (lt BlasLt) Matmul(g Gemm) error {
	const op = "BlasLt.Matmul"
	l, unlock, err := enter(lt.sl, lt.gen, op)
	if err != nil {
		return err
	}
	defer unlock()
	if g.AB == F64 {
		return fmt.Errorf("gpuctx: %s: f64 is not supported by the cuBLASLt path; use Context.Blas: %w", op, ErrInvalid)
	}
	desc, _, err := gemmDesc(l.c.dev, op, &g, 1, 0, 0, 0)
	if err != nil {
		return err
	}
	ws, err := l.c.dev.blas.spaces.Lt(l.s, 0)
	if err != nil {
		return err
	}
	if t := l.s.dev.tracer.Load(); t != nil {
		defer t.begin(l.s, blasName(l.s, "lt matmul"), "blas", gemmArgs(&g, 1))()
	}
	return lt.sl.Handle.lt.Matmul(l.s.hs, desc, ws.Ptr, ws.Size)
}

// Reserve grows the stream's cuBLASLt workspace to at least n bytes. The old
// workspace is freed once the stream has passed the work that may use it.
func (lt BlasLt) Reserve(n int) error {
	l, unlock, err := enter(lt.sl, lt.gen, "BlasLt.Reserve")
	if err != nil {
		return err
	}
	defer unlock()
	_, err = l.c.dev.blas.spaces.Lt(l.s, n)
	return err
}

// blasName names a traced BLAS call: "cublas gemm" on CUDA, "cpu gemm" on
// the CPU backend.
func blasName(s *Stream, op string) string {
	if s.dev.Backend() == "cuda" {
		if op == "lt matmul" {
			return "cublasLt matmul"
		}
		return "cublas " + op
	}
	return s.dev.Backend() + " " + op
}

// gemmArgs are a traced GEMM's arguments.
func gemmArgs(g *Gemm, count int) map[string]any {
	return map[string]any{"m": g.M, "n": g.N, "k": g.K, "ab": g.AB.String(), "c": g.CType.String(), "count": count}
}
