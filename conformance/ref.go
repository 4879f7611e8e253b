package conformance

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/internal/blastest"
)

// The float64 (complex128 for geam) reference the BLAS cases compare with. It
// is deliberately naive and independent of gpuctx's own validation and
// row-major mapping, so a bug there cannot hide in both.

// mat describes one stored matrix: rows×cols as stored (before any
// transpose), leading dimension ld, in layout l.
type mat struct {
	l          gpuctx.Layout
	rows, cols int
	ld         int
}

// at is the index of element (i, j) of m as stored.
func (m mat) at(i, j int) int {
	if m.l == gpuctx.ColMajor {
		return i + j*m.ld
	}
	return i*m.ld + j
}

// span is the number of elements m covers from its first to its last.
func (m mat) span() int {
	if m.rows == 0 || m.cols == 0 {
		return 0
	}
	return m.at(m.rows-1, m.cols-1) + 1
}

// packedLD is the smallest leading dimension of a stored rows×cols matrix.
func packedLD(l gpuctx.Layout, rows, cols int) int {
	if l == gpuctx.ColMajor {
		return max(rows, 1)
	}
	return max(cols, 1)
}

// gemmMats returns A, B and C of the GEMM op(A) m×k, op(B) k×n, C m×n as
// stored, with leading dimensions padded by pad[0..2] elements.
func gemmMats(l gpuctx.Layout, ta, tb bool, m, n, k int, pad [3]int) (a, b, c mat) {
	ar, ac := m, k
	if ta {
		ar, ac = k, m
	}
	br, bc := k, n
	if tb {
		br, bc = n, k
	}
	a = mat{l, ar, ac, packedLD(l, ar, ac) + pad[0]}
	b = mat{l, br, bc, packedLD(l, br, bc) + pad[1]}
	c = mat{l, m, n, packedLD(l, m, n) + pad[2]}
	return a, b, c
}

// refGemm computes C = alpha*op(A)*op(B) + beta*C in float64. With beta == 0, C
// is not read (as BLAS: NaN in C does not propagate).
func refGemm(ta, tb bool, m, n, k int, alpha float64, am mat, a []float64, bm mat, b []float64, beta float64, cm mat, c []float64) {
	for i := range m {
		for j := range n {
			var s float64
			for p := range k {
				ai, aj := i, p
				if ta {
					ai, aj = p, i
				}
				bi, bj := p, j
				if tb {
					bi, bj = j, p
				}
				s += a[am.at(ai, aj)] * b[bm.at(bi, bj)]
			}
			idx := cm.at(i, j)
			if beta == 0 {
				c[idx] = alpha * s
			} else {
				c[idx] = alpha*s + beta*c[idx]
			}
		}
	}
}

// refGeam computes C = alpha*op(A) + beta*op(B) in complex128 (op is the plain
// transpose, never the conjugate one).
func refGeam(ta, tb bool, m, n int, alpha complex128, am mat, a []complex128, beta complex128, bm mat, b []complex128, cm mat, c []complex128) {
	for i := range m {
		for j := range n {
			ai, aj := i, j
			if ta {
				ai, aj = j, i
			}
			bi, bj := i, j
			if tb {
				bi, bj = j, i
			}
			c[cm.at(i, j)] = alpha*a[am.at(ai, aj)] + beta*b[bm.at(bi, bj)]
		}
	}
}

// relErr and relErrComplex are the suite's error measures (internal/blastest).
var (
	relErr        = blastest.RelErr
	relErrComplex = blastest.RelErrComplex
)

// gemmType is a GEMM's input and output element types.
type gemmType struct{ ab, c gpuctx.DType }

func (g gemmType) String() string { return g.ab.String() + "->" + g.c.String() }

// gemmTypes are every type pair gpuctx accepts: a backend must compute them
// all, or fail with ErrUnavailable for those it cannot.
var gemmTypes = []gemmType{
	{gpuctx.F32, gpuctx.F32}, {gpuctx.F64, gpuctx.F64},
	{gpuctx.F16, gpuctx.F16}, {gpuctx.F16, gpuctx.F32},
	{gpuctx.BF16, gpuctx.BF16}, {gpuctx.BF16, gpuctx.F32},
}

// encode stores v as elements of type dt (real types only). The values the
// cases use (small integers times powers of two) are exact in every type.
func encode(dt gpuctx.DType, v []float64) []byte {
	b := make([]byte, dt.Size()*len(v))
	for i, x := range v {
		switch dt {
		case gpuctx.F32:
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(float32(x)))
		case gpuctx.F64:
			binary.LittleEndian.PutUint64(b[8*i:], math.Float64bits(x))
		case gpuctx.F16:
			binary.LittleEndian.PutUint16(b[2*i:], half.F16(float32(x)))
		case gpuctx.BF16:
			binary.LittleEndian.PutUint16(b[2*i:], half.BF16(float32(x)))
		default:
			panic("conformance: encode: type " + dt.String())
		}
	}
	return b
}

// decode reads elements of type dt (real types only).
func decode(dt gpuctx.DType, b []byte) []float64 {
	v := make([]float64, len(b)/dt.Size())
	for i := range v {
		switch dt {
		case gpuctx.F32:
			v[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
		case gpuctx.F64:
			v[i] = math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:]))
		case gpuctx.F16:
			v[i] = float64(half.FromF16(binary.LittleEndian.Uint16(b[2*i:])))
		case gpuctx.BF16:
			v[i] = float64(half.FromBF16(binary.LittleEndian.Uint16(b[2*i:])))
		default:
			panic("conformance: decode: type " + dt.String())
		}
	}
	return v
}

// encodeComplex stores v as elements of type dt: f32, f64 (real parts), c64 or
// c128.
func encodeComplex(dt gpuctx.DType, v []complex128) []byte {
	switch dt {
	case gpuctx.F32, gpuctx.F64:
		re := make([]float64, len(v))
		for i, x := range v {
			re[i] = real(x)
		}
		return encode(dt, re)
	case gpuctx.C64, gpuctx.C128:
		parts := make([]float64, 2*len(v))
		for i, x := range v {
			parts[2*i], parts[2*i+1] = real(x), imag(x)
		}
		if dt == gpuctx.C64 {
			return encode(gpuctx.F32, parts)
		}
		return encode(gpuctx.F64, parts)
	}
	panic("conformance: encodeComplex: type " + dt.String())
}

// intsF64 returns n small integers in [lo, hi] as float64.
func intsF64(r *rand.Rand, n, lo, hi int) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = float64(lo + r.IntN(hi-lo+1))
	}
	return v
}

// decodeComplex reads elements of type dt as encodeComplex stores them.
func decodeComplex(dt gpuctx.DType, b []byte) []complex128 {
	var parts []float64
	switch dt {
	case gpuctx.F32, gpuctx.F64:
		re := decode(dt, b)
		v := make([]complex128, len(re))
		for i, x := range re {
			v[i] = complex(x, 0)
		}
		return v
	case gpuctx.C64:
		parts = decode(gpuctx.F32, b)
	case gpuctx.C128:
		parts = decode(gpuctx.F64, b)
	default:
		panic("conformance: decodeComplex: type " + dt.String())
	}
	v := make([]complex128, len(parts)/2)
	for i := range v {
		v[i] = complex(parts[2*i], parts[2*i+1])
	}
	return v
}

// sameVals checks that got (elements of type dt) equals want exactly: the
// cases' values are exact in every type, so only the sign of a zero may
// differ (0*x and -0*x are both right).
func sameVals(t *testing.T, what string, dt gpuctx.DType, got []byte, want []float64) {
	t.Helper()
	g := decode(dt, got)
	if len(g) != len(want) {
		t.Fatalf("%s: got %d elements, want %d", what, len(g), len(want))
	}
	for i := range g {
		if g[i] != want[i] {
			t.Fatalf("%s: element %d of %d: got %v, want %v (%v elements; relative error of the whole %.3g)", what, i, len(g), g[i], want[i], dt, relErr(g, want))
		}
	}
}

// sameComplex is sameVals for Geam's types.
func sameComplex(t *testing.T, what string, dt gpuctx.DType, got []byte, want []complex128) {
	t.Helper()
	g := decodeComplex(dt, got)
	if len(g) != len(want) {
		t.Fatalf("%s: got %d elements, want %d", what, len(g), len(want))
	}
	for i := range g {
		if g[i] != want[i] {
			t.Fatalf("%s: element %d of %d: got %v, want %v (relative error of the whole %.3g)", what, i, len(g), g[i], want[i], relErrComplex(g, want))
		}
	}
}
