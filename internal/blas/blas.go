// Package blas holds backend-neutral BLAS operation descriptors, their shape
// validation, the row-major to column-major mapping every backend relies on, and
// the operand spans that bounds checks need. The float64 reference that tests
// check results against is in internal/blastest.
//
// Nothing here touches a device. Package gpuctx validates every operation with
// this package before it reaches a backend, so backends never see a bad shape.
package blas

import (
	"fmt"
	"math"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// ErrInvalid is wrapped by every validation error of this package.
var ErrInvalid = hal.ErrInvalid

// Layout says how a matrix is laid out in memory.
type Layout int

const (
	// RowMajor: element (i, j) of an r×c matrix is at i*ld + j, ld >= c.
	RowMajor Layout = iota
	// ColMajor: element (i, j) is at i + j*ld, ld >= r (cuBLAS convention).
	ColMajor
)

// String returns "row-major" or "col-major".
func (l Layout) String() string {
	if l == ColMajor {
		return "col-major"
	}
	return "row-major"
}

// GemmShape is everything about a GEMM but its memory: C = alpha*op(A)*op(B) + beta*C
// with C m×n, op(A) m×k, op(B) k×n. LD values of 0 mean "packed" and are filled
// in by Normalize. ALen, BLen and CLen are the number of elements available in
// each operand's memory (from its offset to the end of its buffer).
type GemmShape struct {
	Layout         Layout
	TransA, TransB bool
	M, N, K        int
	LDA, LDB, LDC  int
	AB, C          hal.DType
	ALen, BLen     int
	CLen           int
	// TF32 is true when the caller asked for TF32 math; it is only valid for f32.
	TF32 bool
}

func bad(format string, args ...any) error {
	return fmt.Errorf("blas: "+format+": %w", append(args, ErrInvalid)...)
}

// stored returns rows and columns of A or B as stored (before op).
func stored(trans bool, r, c int) (int, int) {
	if trans {
		return c, r
	}
	return r, c
}

// minLD returns the smallest legal leading dimension for an r×c stored matrix.
func minLD(l Layout, r, c int) int {
	if l == ColMajor {
		return max(1, r)
	}
	return max(1, c)
}

// need returns the number of elements an r×c stored matrix with leading
// dimension ld spans, saturating at math.MaxInt (so that a huge shape never
// wraps around to a small or negative need and passes a length check).
func need(l Layout, r, c, ld int) int {
	if r <= 0 || c <= 0 {
		return 0
	}
	if l == ColMajor {
		return mulAdd(c-1, ld, r)
	}
	return mulAdd(r-1, ld, c)
}

// mulAdd returns a*b + c for a, b, c >= 0, saturating at math.MaxInt; a
// negative operand also saturates (it never names a valid extent).
func mulAdd(a, b, c int) int {
	if a < 0 || b < 0 || c < 0 {
		return math.MaxInt
	}
	if a != 0 && b > (math.MaxInt-c)/a {
		return math.MaxInt
	}
	return a*b + c
}

// Span is the number of elements a batch of count matrices, each spanning one
// elements and starting stride elements after the previous, covers from the
// start of the first: (count-1)*stride + one, saturating at math.MaxInt. An
// empty matrix (one == 0) or an empty batch covers nothing.
func Span(count, stride, one int) int {
	if count <= 0 || one == 0 {
		return 0
	}
	return mulAdd(count-1, stride, one)
}

// Bytes converts an element count to bytes for elements of size es,
// saturating at math.MaxInt.
func Bytes(elems, es int) int { return mulAdd(elems, es, 0) }

// DescSpans returns how many elements the column-major GEMM d reads or writes
// from each of its pointers A, B and C, over the batch b (use
// StridedBatch{Count: 1} for one GEMM). This is the extent of the descriptor a
// backend executes, after the row-major mapping; every value saturates at
// math.MaxInt.
func DescSpans(d hal.GemmDesc, b hal.StridedBatch) (a, bb, c int) {
	if d.M <= 0 || d.N <= 0 {
		return 0, 0, 0 // no output, nothing is read
	}
	ar, ac := stored(d.TransA == hal.Trans, d.M, d.K)
	br, bc := stored(d.TransB == hal.Trans, d.K, d.N)
	return Span(b.Count, clampInt(b.StrideA), need(ColMajor, ar, ac, d.LDA)),
		Span(b.Count, clampInt(b.StrideB), need(ColMajor, br, bc, d.LDB)),
		Span(b.Count, clampInt(b.StrideC), need(ColMajor, d.M, d.N, d.LDC))
}

// GeamDescSpans returns how many elements the column-major geam d touches from
// A, B and C.
func GeamDescSpans(d hal.GeamDesc) (a, b, c int) {
	if d.M <= 0 || d.N <= 0 {
		return 0, 0, 0
	}
	ar, ac := stored(d.TransA == hal.Trans, d.M, d.N)
	br, bc := stored(d.TransB == hal.Trans, d.M, d.N)
	return need(ColMajor, ar, ac, d.LDA), need(ColMajor, br, bc, d.LDB), need(ColMajor, d.M, d.N, d.LDC)
}

func clampInt(x int64) int {
	if x < 0 || uint64(x) > uint64(math.MaxInt) {
		return math.MaxInt
	}
	return int(x)
}

// SupportedGemm reports whether a GEMM with inputs ab and output c is supported:
// f32->f32, f64->f64, f16->f16|f32, bf16->bf16|f32.
func SupportedGemm(ab, c hal.DType) bool {
	switch ab {
	case hal.F32:
		return c == hal.F32
	case hal.F64:
		return c == hal.F64
	case hal.F16:
		return c == hal.F16 || c == hal.F32
	case hal.BF16:
		return c == hal.BF16 || c == hal.F32
	}
	return false
}

// Normalize fills packed leading dimensions and validates g. The error names
// the bad field and its value.
func (g *GemmShape) Normalize() error {
	if g.M < 0 || g.N < 0 || g.K < 0 {
		return bad("gemm dimensions must be >= 0, got m=%d n=%d k=%d", g.M, g.N, g.K)
	}
	if g.Layout != RowMajor && g.Layout != ColMajor {
		return bad("gemm layout %d is neither RowMajor nor ColMajor", g.Layout)
	}
	if !SupportedGemm(g.AB, g.C) {
		return bad("gemm dtypes A/B=%v C=%v are not supported (f32->f32, f64->f64, f16->f16|f32, bf16->bf16|f32)", g.AB, g.C)
	}
	if g.TF32 && g.AB != hal.F32 {
		return bad("TF32 math applies to f32 GEMMs only, got A/B=%v", g.AB)
	}
	ar, ac := stored(g.TransA, g.M, g.K)
	br, bc := stored(g.TransB, g.K, g.N)
	type op struct {
		name   string
		r, c   int
		ld     *int
		length int
	}
	for _, o := range []op{{"A", ar, ac, &g.LDA, g.ALen}, {"B", br, bc, &g.LDB, g.BLen}, {"C", g.M, g.N, &g.LDC, g.CLen}} {
		lo := minLD(g.Layout, o.r, o.c)
		if *o.ld == 0 {
			*o.ld = lo
		}
		if *o.ld < lo {
			return bad("ld%s=%d is smaller than %d, the minimum for a %s %d×%d matrix", lowerName(o.name), *o.ld, lo, g.Layout, o.r, o.c)
		}
		if n := need(g.Layout, o.r, o.c, *o.ld); n > o.length {
			return bad("%s needs %d elements (%d×%d, ld %d, %s) but its buffer holds %d", o.name, n, o.r, o.c, *o.ld, g.Layout, o.length)
		}
	}
	return nil
}

func lowerName(s string) string {
	switch s {
	case "A":
		return "a"
	case "B":
		return "b"
	}
	return "c"
}

// ColMajorDesc maps a normalized shape onto the column-major GemmDesc that
// backends execute. Row-major C = op(A)op(B) is computed as the column-major
// C^T = op(B)^T op(A)^T: operands swapped, m and n swapped, same transposes.
func (g *GemmShape) ColMajorDesc(a, b, c hal.Ptr, alpha, beta float64) hal.GemmDesc {
	ta, tb := op(g.TransA), op(g.TransB)
	if g.Layout == ColMajor {
		return hal.GemmDesc{TransA: ta, TransB: tb, M: g.M, N: g.N, K: g.K, Alpha: alpha, Beta: beta,
			A: a, LDA: g.LDA, B: b, LDB: g.LDB, C: c, LDC: g.LDC, AB: g.AB, CType: g.C}
	}
	return hal.GemmDesc{TransA: tb, TransB: ta, M: g.N, N: g.M, K: g.K, Alpha: alpha, Beta: beta,
		A: b, LDA: g.LDB, B: a, LDB: g.LDA, C: c, LDC: g.LDC, AB: g.AB, CType: g.C}
}

// ColMajorBatch maps the strides of a strided batch of GEMMs of shape g (in
// elements of the user's A, B and C) onto the descriptor ColMajorDesc returns:
// for a row-major GEMM the descriptor's A is the user's B and its B the user's
// A, so their strides swap with them. C keeps its stride.
func (g *GemmShape) ColMajorBatch(count, strideA, strideB, strideC int) hal.StridedBatch {
	if g.Layout == RowMajor {
		strideA, strideB = strideB, strideA
	}
	return hal.StridedBatch{Count: count, StrideA: int64(strideA), StrideB: int64(strideB), StrideC: int64(strideC)}
}

// DescOperands names the user's operands in the order of the descriptor
// ColMajorDesc returns: ("A", "B") for column-major, ("B", "A") for row-major,
// where the mapping swaps them.
func (g *GemmShape) DescOperands() (descA, descB string) {
	if g.Layout == RowMajor {
		return "B", "A"
	}
	return "A", "B"
}

func op(t bool) hal.Op {
	if t {
		return hal.Trans
	}
	return hal.NoTrans
}

// GeamShape is C = alpha*op(A) + beta*op(B) with C m×n, for f32, f64, c64, c128.
type GeamShape struct {
	Layout           Layout
	TransA, TransB   bool
	M, N             int
	LDA, LDB, LDC    int
	Type             hal.DType
	ALen, BLen, CLen int
}

// Normalize fills packed leading dimensions and validates g.
func (g *GeamShape) Normalize() error {
	if g.M < 0 || g.N < 0 {
		return bad("geam dimensions must be >= 0, got m=%d n=%d", g.M, g.N)
	}
	switch g.Type {
	case hal.F32, hal.F64, hal.C64, hal.C128:
	default:
		return bad("geam dtype %v is not supported (f32, f64, c64, c128)", g.Type)
	}
	ar, ac := stored(g.TransA, g.M, g.N)
	br, bc := stored(g.TransB, g.M, g.N)
	for _, o := range []struct {
		name   string
		r, c   int
		ld     *int
		length int
	}{{"A", ar, ac, &g.LDA, g.ALen}, {"B", br, bc, &g.LDB, g.BLen}, {"C", g.M, g.N, &g.LDC, g.CLen}} {
		lo := minLD(g.Layout, o.r, o.c)
		if *o.ld == 0 {
			*o.ld = lo
		}
		if *o.ld < lo {
			return bad("ld%s=%d is smaller than %d, the minimum for a %s %d×%d matrix", lowerName(o.name), *o.ld, lo, g.Layout, o.r, o.c)
		}
		if n := need(g.Layout, o.r, o.c, *o.ld); n > o.length {
			return bad("%s needs %d elements (%d×%d, ld %d, %s) but its buffer holds %d", o.name, n, o.r, o.c, *o.ld, g.Layout, o.length)
		}
	}
	return nil
}

// ColMajorDesc maps a normalized geam onto the column-major descriptor. A
// row-major geam is the column-major geam of the transposes: C^T = a op(A)^T + b op(B)^T,
// so only m and n swap.
func (g *GeamShape) ColMajorDesc(a, b, c hal.Ptr, alpha, beta complex128) hal.GeamDesc {
	d := hal.GeamDesc{TransA: op(g.TransA), TransB: op(g.TransB), M: g.M, N: g.N, Alpha: alpha, Beta: beta,
		A: a, LDA: g.LDA, B: b, LDB: g.LDB, C: c, LDC: g.LDC, Type: g.Type}
	if g.Layout == RowMajor {
		d.M, d.N = g.N, g.M
	}
	return d
}
