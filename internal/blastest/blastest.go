// Package blastest holds the float64 reference BLAS that tests, the
// conformance suite and the CLI's checks compare device results with, and the
// relative-error measure they use. It is test support, not part of the API.
package blastest

import (
	"math"
	"math/cmplx"

	"github.com/gpuctx/gpuctx/internal/blas"
)

// RefGemm computes C = alpha*op(A)*op(B) + beta*C in float64 on host slices laid
// out as g says (g must be normalized).
func RefGemm(g blas.GemmShape, alpha float64, a, b []float64, beta float64, c []float64) {
	at := func(l blas.Layout, x []float64, ld, i, j int) float64 {
		if l == blas.ColMajor {
			return x[i+j*ld]
		}
		return x[i*ld+j]
	}
	for i := 0; i < g.M; i++ {
		for j := 0; j < g.N; j++ {
			var s float64
			for p := 0; p < g.K; p++ {
				var av, bv float64
				if g.TransA {
					av = at(g.Layout, a, g.LDA, p, i)
				} else {
					av = at(g.Layout, a, g.LDA, i, p)
				}
				if g.TransB {
					bv = at(g.Layout, b, g.LDB, j, p)
				} else {
					bv = at(g.Layout, b, g.LDB, p, j)
				}
				s += av * bv
			}
			idx := i*g.LDC + j
			if g.Layout == blas.ColMajor {
				idx = i + j*g.LDC
			}
			if beta == 0 {
				c[idx] = alpha * s
			} else {
				c[idx] = alpha*s + beta*c[idx]
			}
		}
	}
}

// RefGeam computes C = alpha*op(A) + beta*op(B) in complex128 (g normalized).
func RefGeam(g blas.GeamShape, alpha complex128, a []complex128, beta complex128, b []complex128, c []complex128) {
	at := func(x []complex128, ld int, trans bool, i, j int) complex128 {
		if trans {
			i, j = j, i
		}
		if g.Layout == blas.ColMajor {
			return x[i+j*ld]
		}
		return x[i*ld+j]
	}
	for i := 0; i < g.M; i++ {
		for j := 0; j < g.N; j++ {
			idx := i*g.LDC + j
			if g.Layout == blas.ColMajor {
				idx = i + j*g.LDC
			}
			c[idx] = alpha*at(a, g.LDA, g.TransA, i, j) + beta*at(b, g.LDB, g.TransB, i, j)
		}
	}
}

// RelErr returns ||got-want||_F / ||want||_F (or ||got-want|| when want is 0).
// NaN in got gives +Inf so that it never passes a tolerance.
func RelErr(got, want []float64) float64 {
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

// RelErrComplex is RelErr for complex values.
func RelErrComplex(got, want []complex128) float64 {
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
