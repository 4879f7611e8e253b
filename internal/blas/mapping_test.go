package blas_test

import (
	"math/rand/v2"
	"testing"

	"github.com/gpuctx/gpuctx/internal/blas"
	"github.com/gpuctx/gpuctx/internal/blastest"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// TestColMajorMapping checks that the column-major descriptor of a row-major
// GEMM computes the same product: run the descriptor through RefGemm in
// column-major terms and compare with the row-major reference.
func TestColMajorMapping(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	for _, ta := range []bool{false, true} {
		for _, tb := range []bool{false, true} {
			const m, n, k = 3, 5, 4
			a, b := randVec(r, m*k), randVec(r, k*n)
			g := blas.GemmShape{TransA: ta, TransB: tb, M: m, N: n, K: k, AB: hal.F32, C: hal.F32, ALen: m * k, BLen: k * n, CLen: m * n}
			if err := g.Normalize(); err != nil {
				t.Fatal(err)
			}
			want := make([]float64, m*n)
			blastest.RefGemm(g, 1, a, b, 0, want)
			d := g.ColMajorDesc(1, 2, 3, 1, 0)
			if d.A != 2 || d.B != 1 || d.M != n || d.N != m {
				t.Fatalf("row-major mapping must swap operands and m/n: %+v", d)
			}
			cm := blas.GemmShape{Layout: blas.ColMajor, TransA: d.TransA == hal.Trans, TransB: d.TransB == hal.Trans, M: d.M, N: d.N, K: d.K,
				LDA: d.LDA, LDB: d.LDB, LDC: d.LDC, AB: hal.F32, C: hal.F32, ALen: k * n, BLen: m * k, CLen: m * n}
			got := make([]float64, m*n)
			blastest.RefGemm(cm, 1, b, a, 0, got)
			if e := blastest.RelErr(got, want); e > 1e-14 {
				t.Fatalf("ta=%v tb=%v: mapped product differs: %g", ta, tb, e)
			}
		}
	}
}

func randVec(r *rand.Rand, n int) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = r.NormFloat64()
	}
	return x
}
