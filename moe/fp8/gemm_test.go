package fp8

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/half"
)

// refGemm is y = x W^T in float64: y[t][n] = sum_k x[t][k] * w[n][k].
func refGemm(x, w []float32, tokens, rows, cols int) []float64 {
	y := make([]float64, tokens*rows)
	for t := range tokens {
		for n := range rows {
			var s float64
			for k := range cols {
				s += float64(x[t*cols+k]) * float64(w[n*cols+k])
			}
			y[t*rows+n] = s
		}
	}
	return y
}

// relErr is max |got - ref| / max |ref|, the issue's accuracy measure.
func relErr(got []float32, ref []float64) float64 {
	var d, m float64
	for i, r := range ref {
		d = max(d, math.Abs(float64(got[i])-r))
		m = max(m, math.Abs(r))
	}
	return d / m
}

// bf16Acts returns tokens x cols activations rounded to bfloat16, normal
// with a few outliers per token, as real hidden states have.
func bf16Acts(tokens, cols int, seed uint64) []float32 {
	r := rand.New(rand.NewPCG(seed, 11))
	x := make([]float32, tokens*cols)
	for i := range x {
		v := r.NormFloat64()
		if r.IntN(97) == 0 {
			v *= 20
		}
		x[i] = half.FromBF16(half.BF16(float32(v)))
	}
	return x
}

var gemmShapes = []struct {
	name               string
	tokens, rows, cols int
}{
	{"partial blocks", 3, 136, 300},
	{"one token, one block", 1, 5, 7},
	{"full blocks", 7, 256, 384},
	{"DeepSeek-V2-Lite down_proj [2048, 1408]", 2, 2048, 1408},
	{"Qwen3-30B-A3B gate_proj [768, 2048]", 3, 768, 2048},
}

// TestGemmW8A16 measures GemmW8A16 against a float64 GEMM on the dequantized
// weights: within the issue's 1e-2, and in fact within float32 rounding
// (1e-5), which fails when a block scale is applied to the wrong block.
func TestGemmW8A16(t *testing.T) {
	for _, tc := range gemmShapes {
		t.Run(tc.name, func(t *testing.T) {
			w, err := Quantize(randMatrix(tc.rows, tc.cols, 5), tc.rows, tc.cols, defaultBlock)
			if err != nil {
				t.Fatal(err)
			}
			deq, err := w.Dequantize()
			if err != nil {
				t.Fatal(err)
			}
			x := bf16Acts(tc.tokens, tc.cols, 6)
			y := make([]float32, tc.tokens*tc.rows)
			if err := GemmW8A16(y, x, tc.tokens, w); err != nil {
				t.Fatal(err)
			}
			e := relErr(y, refGemm(x, deq, tc.tokens, tc.rows, tc.cols))
			t.Logf("w8a16 max|d|/max|ref| = %.3g", e)
			if e > 1e-2 || e > 1e-5 {
				t.Errorf("w8a16 max|d|/max|ref| = %.3g, want <= 1e-5 (the issue's bound is 1e-2)", e)
			}
		})
	}
}

// TestGemmW8A8 measures GemmW8A8 against a float64 GEMM on the dequantized
// weights and the real (unquantized) activations: within the issue's 3e-2.
// Against the dequantized activations it must be within float32 rounding,
// which fails when an activation or weight scale is misapplied.
func TestGemmW8A8(t *testing.T) {
	for _, tc := range gemmShapes {
		t.Run(tc.name, func(t *testing.T) {
			w, err := Quantize(randMatrix(tc.rows, tc.cols, 5), tc.rows, tc.cols, defaultBlock)
			if err != nil {
				t.Fatal(err)
			}
			deq, err := w.Dequantize()
			if err != nil {
				t.Fatal(err)
			}
			x := bf16Acts(tc.tokens, tc.cols, 6)
			xq, err := QuantizeActivations(x, tc.tokens, tc.cols, BlockSize)
			if err != nil {
				t.Fatal(err)
			}
			y := make([]float32, tc.tokens*tc.rows)
			if err := GemmW8A8(y, xq, w); err != nil {
				t.Fatal(err)
			}
			e := relErr(y, refGemm(x, deq, tc.tokens, tc.rows, tc.cols))
			xd, err := xq.Dequantize()
			if err != nil {
				t.Fatal(err)
			}
			eq := relErr(y, refGemm(xd, deq, tc.tokens, tc.rows, tc.cols))
			t.Logf("w8a8 max|d|/max|ref| = %.3g (against the dequantized activations: %.3g)", e, eq)
			if e > 3e-2 {
				t.Errorf("w8a8 max|d|/max|ref| = %.3g, want <= 3e-2", e)
			}
			if eq > 1e-5 {
				t.Errorf("w8a8 against the dequantized activations: max|d|/max|ref| = %.3g, want <= 1e-5", eq)
			}
		})
	}
}

// TestGemmOrder pins the documented accumulation order: with values chosen
// so that the order matters in float32 (one sum per block, then the scaled
// block sums), GemmW8A16 gives what that order gives by hand; summing the
// scaled products in one chain would give 2^24 + 4.
func TestGemmOrder(t *testing.T) {
	const K = 256 // two blocks
	codes := make([]uint8, K)
	x := make([]float32, K)
	for k := range K {
		codes[k] = E4M3(1)
		x[k] = 1
	}
	x[0] = 1 << 24 // block 0: 2^24 + 127 ones, each lost to rounding
	w := &Weight{Rows: 1, Cols: K, Block: defaultBlock, Codes: codes, Scales: []float32{1, 3}}
	y := make([]float32, 1)
	if err := GemmW8A16(y, x, 1, w); err != nil {
		t.Fatal(err)
	}
	// Block 0 sums to 2^24 (each +1 rounds away), block 1 to 128; then
	// 2^24*1 + 128*3 = 16777600.
	if want := float32(1<<24 + 384); y[0] != want {
		t.Errorf("GemmW8A16 = %v, want %v (block sums, then scales)", y[0], want)
	}
	xq := &Activations{Tokens: 1, Cols: K, Group: BlockSize, Codes: codes, Scales: []float32{2, 0.5}}
	if err := GemmW8A8(y, xq, w); err != nil {
		t.Fatal(err)
	}
	if want := float32(128*2*1 + 128*0.5*3); y[0] != want {
		t.Errorf("GemmW8A8 = %v, want %v", y[0], want)
	}
}

func TestGemmErrors(t *testing.T) {
	w, err := Quantize(randMatrix(4, 200, 1), 4, 200, defaultBlock)
	if err != nil {
		t.Fatal(err)
	}
	x := bf16Acts(2, 200, 1)
	xq, _ := QuantizeActivations(x, 2, 200, BlockSize)
	x64, _ := QuantizeActivations(x, 2, 200, 64)
	bad := *w
	bad.Scales = []float32{1, float32(math.NaN())}
	for _, tc := range []struct {
		name string
		run  func() error
		want string
	}{
		{"w8a16 y length", func() error { return GemmW8A16(make([]float32, 7), x, 2, w) }, "y has 7 values, want [2 tokens][4] = 8"},
		{"w8a16 x length", func() error { return GemmW8A16(make([]float32, 8), x[:300], 2, w) }, "x has 300 values, want [2 tokens][200] = 400"},
		{"w8a16 no tokens", func() error { return GemmW8A16(nil, nil, 0, w) }, "0 tokens"},
		{"w8a16 bad scale", func() error { return GemmW8A16(make([]float32, 8), x, 2, &bad) }, "scale_inv [0][1] = NaN"},
		{"w8a16 nil weight", func() error { return GemmW8A16(make([]float32, 8), x, 2, nil) }, "nil *Weight"},
		{"w8a8 group", func() error { return GemmW8A8(make([]float32, 8), x64, w) }, "activation groups of 64 columns, but the weight's blocks are 128 columns wide"},
		{"w8a8 y length", func() error { return GemmW8A8(make([]float32, 9), xq, w) }, "y has 9 values"},
		{"w8a8 nil activations", func() error { return GemmW8A8(make([]float32, 8), nil, w) }, "nil *Activations"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.run()
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "fp8: Gemm") {
				t.Errorf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func ExampleGemmW8A16() {
	// One expert projection [out 3, in 4] with one token.
	w, _ := Quantize([]float32{
		1, 0, 0, 0,
		0, 2, 0, 0,
		0, 0, 0, -448,
	}, 3, 4, [2]int{BlockSize, BlockSize})
	y := make([]float32, 3)
	_ = GemmW8A16(y, []float32{1, 1, 1, 1}, 1, w)
	fmt.Println(y)
	// Output: [1 2 -448]
}
