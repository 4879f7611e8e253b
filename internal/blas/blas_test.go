package blas

import (
	"errors"
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
