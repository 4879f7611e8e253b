package conformance

import (
	"math"
	"math/cmplx"

	"github.com/gpuctx/gpuctx"
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

// relErr returns ||got-want|| / ||want|| (||got-want|| when want is 0); NaN or
// Inf in got gives +Inf so that it never passes a tolerance.
func relErr(got, want []float64) float64 {
	var num, den float64
	for i := range want {
		if math.IsNaN(got[i]) || math.IsInf(got[i], 0) {
			return math.Inf(1)
		}
		d := got[i] - want[i]
		num += d * d
		den += want[i] * want[i]
	}
	if den == 0 {
		return math.Sqrt(num)
	}
	return math.Sqrt(num / den)
}

// relErrComplex is relErr for complex values.
func relErrComplex(got, want []complex128) float64 {
	var num, den float64
	for i := range want {
		if cmplx.IsNaN(got[i]) || cmplx.IsInf(got[i]) {
			return math.Inf(1)
		}
		d := cmplx.Abs(got[i] - want[i])
		num += d * d
		w := cmplx.Abs(want[i])
		den += w * w
	}
	if den == 0 {
		return math.Sqrt(num)
	}
	return math.Sqrt(num / den)
}
