package blas

import (
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/internal/hal"
)

func TestGemmShapeNormalize(t *testing.T) {
	ok := GemmShape{M: 4, N: 3, K: 5, AB: hal.F32, C: hal.F32, ALen: 20, BLen: 15, CLen: 12}
	cases := []struct {
		name string
		edit func(g *GemmShape)
		want string // "" = valid
	}{
		{"packed row-major", func(*GemmShape) {}, ""},
		{"packed col-major", func(g *GemmShape) { g.Layout = ColMajor }, ""},
		{"transposed A row-major", func(g *GemmShape) { g.TransA = true }, ""},
		{"negative k", func(g *GemmShape) { g.K = -1 }, "k=-1"},
		{"lda too small", func(g *GemmShape) { g.LDA = 4 }, "lda=4 is smaller than 5"},
		{"ldc too small col-major", func(g *GemmShape) { g.Layout = ColMajor; g.LDC = 3 }, "ldc=3 is smaller than 4"},
		{"B too short", func(g *GemmShape) { g.BLen = 14 }, "B needs 15 elements"},
		{"C too short with ld", func(g *GemmShape) { g.LDC = 4 }, "C needs 15 elements"},
		{"bf16 to f32", func(g *GemmShape) { g.AB = hal.BF16 }, ""},
		{"f64 to f32", func(g *GemmShape) { g.AB = hal.F64 }, "A/B=f64 C=f32"},
		{"tf32 on bf16", func(g *GemmShape) { g.AB = hal.BF16; g.TF32 = true }, "TF32"},
		{"bad layout", func(g *GemmShape) { g.Layout = 7 }, "layout 7"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g := ok
			c.edit(&g)
			err := g.Normalize()
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("unexpected error %v", err)
			case c.want != "" && (err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want)):
				t.Fatalf("want ErrInvalid mentioning %q, got %v", c.want, err)
			}
		})
	}
}

// TestColMajorMapping checks that the column-major descriptor of a row-major
// GEMM computes the same product: run the descriptor through RefGemm in
// column-major terms and compare with the row-major reference.
func TestColMajorMapping(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	for _, ta := range []bool{false, true} {
		for _, tb := range []bool{false, true} {
			const m, n, k = 3, 5, 4
			a, b := randVec(r, m*k), randVec(r, k*n)
			g := GemmShape{TransA: ta, TransB: tb, M: m, N: n, K: k, AB: hal.F32, C: hal.F32, ALen: m * k, BLen: k * n, CLen: m * n}
			if err := g.Normalize(); err != nil {
				t.Fatal(err)
			}
			want := make([]float64, m*n)
			RefGemm(g, 1, a, b, 0, want)
			d := g.ColMajorDesc(1, 2, 3, 1, 0)
			if d.A != 2 || d.B != 1 || d.M != n || d.N != m {
				t.Fatalf("row-major mapping must swap operands and m/n: %+v", d)
			}
			cm := GemmShape{Layout: ColMajor, TransA: d.TransA == hal.Trans, TransB: d.TransB == hal.Trans, M: d.M, N: d.N, K: d.K,
				LDA: d.LDA, LDB: d.LDB, LDC: d.LDC, AB: hal.F32, C: hal.F32, ALen: k * n, BLen: m * k, CLen: m * n}
			got := make([]float64, m*n)
			RefGemm(cm, 1, b, a, 0, got)
			if e := RelErr(got, want); e > 1e-14 {
				t.Fatalf("ta=%v tb=%v: mapped product differs: %g", ta, tb, e)
			}
		}
	}
}

func TestRelErrNaN(t *testing.T) {
	if e := RelErr([]float64{math.NaN()}, []float64{1}); !math.IsInf(e, 1) {
		t.Fatalf("NaN must never pass a tolerance, got %g", e)
	}
}

func randVec(r *rand.Rand, n int) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = r.NormFloat64()
	}
	return x
}
