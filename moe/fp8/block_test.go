package fp8

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

func TestScaleShape(t *testing.T) {
	for _, tc := range []struct {
		rows, cols int
		want       [2]int
	}{
		{7168, 2048, [2]int{56, 16}}, // DeepSeek-V3 expert down_proj [H, I]
		{2048, 7168, [2]int{16, 56}}, // and its gate_proj [I, H]
		{1408, 2048, [2]int{11, 16}}, // DeepSeek-V2-Lite expert
		{768, 2048, [2]int{6, 16}},   // Qwen3-30B-A3B expert
		{128, 128, [2]int{1, 1}},
		{129, 128, [2]int{2, 1}},
		{128, 129, [2]int{1, 2}},
		{300, 130, [2]int{3, 2}},
		{1, 1, [2]int{1, 1}},
	} {
		if got := ScaleShape(tc.rows, tc.cols, defaultBlock); got != tc.want {
			t.Errorf("ScaleShape(%d, %d) = %v, want %v", tc.rows, tc.cols, got, tc.want)
		}
	}
}

// randMatrix returns rows x cols normal values whose magnitude differs per
// 128x128 block (by 4^(block row + 2*block column)), so that a block scale
// computed over the wrong elements is caught.
func randMatrix(rows, cols int, seed uint64) []float32 {
	r := rand.New(rand.NewPCG(seed, 7))
	w := make([]float32, rows*cols)
	for i := range rows {
		for j := range cols {
			w[i*cols+j] = float32(r.NormFloat64() * math.Pow(4, float64(i/BlockSize+2*(j/BlockSize)-3)))
		}
	}
	return w
}

// TestQuantize checks the block rule on full and partial blocks: every scale
// is max(amax, 1e-10)/448 over exactly its block, every code is the clamped
// PyTorch cast of w/s (an independent oracle), the largest value of each
// block maps to +-448, and the dequantized weights are within half an E4M3
// step of the originals.
func TestQuantize(t *testing.T) {
	for _, tc := range []struct{ rows, cols int }{{256, 384}, {300, 130}, {1, 1}, {5, 257}, {129, 3}} {
		w := randMatrix(tc.rows, tc.cols, uint64(tc.rows*1000+tc.cols))
		q, err := Quantize(w, tc.rows, tc.cols, defaultBlock)
		if err != nil {
			t.Fatal(err)
		}
		if err := q.Check(); err != nil {
			t.Fatal(err)
		}
		ss := ScaleShape(tc.rows, tc.cols, defaultBlock)
		amax := make([]float32, ss[0]*ss[1])
		for i := range tc.rows {
			for j := range tc.cols {
				b := (i/BlockSize)*ss[1] + j/BlockSize
				amax[b] = max(amax[b], float32(math.Abs(float64(w[i*tc.cols+j]))))
			}
		}
		for b, a := range amax {
			if want := max(a, 1e-10) / 448; q.Scales[b] != want {
				t.Errorf("%dx%d: scale %d = %v, want amax %v / 448 = %v", tc.rows, tc.cols, b, q.Scales[b], a, want)
			}
		}
		deq, err := q.Dequantize()
		if err != nil {
			t.Fatal(err)
		}
		for i := range tc.rows {
			for j := range tc.cols {
				k := i*tc.cols + j
				s := q.Scales[(i/BlockSize)*ss[1]+j/BlockSize]
				if want := clampedTorchE4M3(w[k] / s); q.Codes[k] != want {
					t.Fatalf("%dx%d: code [%d][%d] = %#02x, want %#02x", tc.rows, tc.cols, i, j, q.Codes[k], want)
				}
				if abs32(w[k]) == amax[(i/BlockSize)*ss[1]+j/BlockSize] && q.Codes[k]&0x7f != MaxCodeE4M3 {
					t.Errorf("%dx%d: the block maximum [%d][%d] = %v has code %#02x, want +-448", tc.rows, tc.cols, i, j, w[k], q.Codes[k])
				}
				// Half a step: 2^-4 relative for normals, 2^-10 * s for subnormals.
				bound := (math.Abs(float64(w[k]))/16 + float64(s)/1024) * (1 + 1e-6)
				if d := math.Abs(float64(deq[k]) - float64(w[k])); d > bound {
					t.Fatalf("%dx%d: [%d][%d]: %v dequantizes to %v, off by %v > %v", tc.rows, tc.cols, i, j, w[k], deq[k], d, bound)
				}
			}
		}
	}
}

// TestQuantizeExact: weights that are E4M3 values times a power of two, with
// +-448 in every block, quantize to the same codes with that power as scale,
// and dequantize exactly.
func TestQuantizeExact(t *testing.T) {
	rows, cols := 200, 300
	ss := ScaleShape(rows, cols, defaultBlock)
	r := rand.New(rand.NewPCG(3, 4))
	codes := make([]uint8, rows*cols)
	w := make([]float32, rows*cols)
	pow := func(i, j int) float32 { return float32(math.Ldexp(1, -(i/BlockSize)*3-(j/BlockSize)*5)) }
	for i := range rows {
		for j := range cols {
			c := uint8(r.IntN(256))
			if c&0x7f == 0x7f {
				c = 0
			}
			if i%BlockSize == 0 && j%BlockSize == 0 {
				c = MaxCodeE4M3 // the block's maximum
			}
			codes[i*cols+j] = c
			w[i*cols+j] = FromE4M3(c) * pow(i, j)
		}
	}
	q, err := Quantize(w, rows, cols, defaultBlock)
	if err != nil {
		t.Fatal(err)
	}
	for b, s := range q.Scales {
		if want := pow((b/ss[1])*BlockSize, (b%ss[1])*BlockSize); s != want {
			t.Errorf("scale %d = %v, want %v", b, s, want)
		}
	}
	for k := range codes {
		if q.Codes[k] != codes[k] {
			t.Fatalf("code %d = %#02x, want %#02x", k, q.Codes[k], codes[k])
		}
	}
	deq, err := q.Dequantize()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(deq, w) {
		t.Error("dequantized weights differ from the exact originals")
	}
}

func TestQuantizeZeroBlock(t *testing.T) {
	q, err := Quantize(make([]float32, 130*5), 130, 5, defaultBlock)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range q.Scales {
		if s != float32(1e-10)/448 {
			t.Errorf("an all-zero block's scale is %v, want 1e-10/448", s)
		}
	}
	if err := q.Check(); err != nil {
		t.Error(err)
	}
}

func TestQuantizeErrors(t *testing.T) {
	nanAt := func(k int, v float32) []float32 {
		w := make([]float32, 6*200)
		w[k] = v
		return w
	}
	for _, tc := range []struct {
		name       string
		w          []float32
		rows, cols int
		block      [2]int
		want       string
	}{
		{"NaN", nanAt(201, float32(math.NaN())), 6, 200, defaultBlock, "weight [1][1] is NaN"},
		{"Inf in a partial block", nanAt(5*200+199, float32(math.Inf(-1))), 6, 200, defaultBlock, "weight [5][199] is -Inf"},
		{"length", make([]float32, 5), 2, 3, defaultBlock, "5 values for shape [2, 3], want 6"},
		{"empty", nil, 0, 3, defaultBlock, "shape [0, 3] is empty"},
		{"block", make([]float32, 6), 2, 3, [2]int{0, 128}, "block size [0 128] is not positive"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Quantize(tc.w, tc.rows, tc.cols, tc.block)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), "fp8: Quantize: ") {
				t.Errorf("err = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestWeightCheck(t *testing.T) {
	good := func() *Weight {
		return &Weight{Rows: 130, Cols: 2, Block: defaultBlock, Codes: make([]uint8, 260), Scales: []float32{1, 2}}
	}
	for _, tc := range []struct {
		name  string
		mod   func(w *Weight)
		want  string
		valid bool
	}{
		{"good", func(*Weight) {}, "", true},
		{"NaN code", func(w *Weight) { w.Codes[129*2+1] = 0xff }, "weight [129][1] is the E4M3 NaN code 0xff", false},
		{"zero scale", func(w *Weight) { w.Scales[1] = 0 }, "scale_inv [1][0] = 0: block scales must be finite and positive", false},
		{"negative scale", func(w *Weight) { w.Scales[0] = -1 }, "scale_inv [0][0] = -1", false},
		{"NaN scale", func(w *Weight) { w.Scales[0] = float32(math.NaN()) }, "scale_inv [0][0] = NaN", false},
		{"Inf scale", func(w *Weight) { w.Scales[1] = float32(math.Inf(1)) }, "scale_inv [1][0] = +Inf", false},
		{"scale count", func(w *Weight) { w.Scales = w.Scales[:1] }, "1 scales for a [130, 2] weight in 128x128 blocks, want [2 1] = 2", false},
		{"code count", func(w *Weight) { w.Codes = w.Codes[:7] }, "7 values for shape [130, 2]", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := good()
			tc.mod(w)
			err := w.Check()
			if tc.valid != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Errorf("Check() = %v, want %q", err, tc.want)
			}
			if _, derr := w.Dequantize(); (derr == nil) != tc.valid {
				t.Errorf("Dequantize() error = %v, valid = %v", derr, tc.valid)
			}
		})
	}
	if err := (*Weight)(nil).Check(); err == nil {
		t.Error("nil Weight passes Check")
	}
}

// TestQuantizeActivations checks vLLM's per-token-group rule on full and
// partial groups against an independent float32 computation with the
// clamped PyTorch cast, and the round trip bound.
func TestQuantizeActivations(t *testing.T) {
	for _, tc := range []struct{ tokens, cols int }{{3, 300}, {1, 128}, {5, 7}, {2, 1408}} {
		x := randMatrix(tc.tokens, tc.cols, uint64(tc.cols))
		a, err := QuantizeActivations(x, tc.tokens, tc.cols, BlockSize)
		if err != nil {
			t.Fatal(err)
		}
		g := ceilDiv(tc.cols, BlockSize)
		for tk := range tc.tokens {
			for gi := range g {
				k0, k1 := gi*BlockSize, min((gi+1)*BlockSize, tc.cols)
				var amax float32
				for k := k0; k < k1; k++ {
					amax = max(amax, abs32(x[tk*tc.cols+k]))
				}
				s := max(amax, 1e-10) / 448
				if a.Scales[tk*g+gi] != s {
					t.Fatalf("%v: scale [%d][%d] = %v, want %v", tc, tk, gi, a.Scales[tk*g+gi], s)
				}
				for k := k0; k < k1; k++ {
					if want := clampedTorchE4M3(x[tk*tc.cols+k] / s); a.Codes[tk*tc.cols+k] != want {
						t.Fatalf("%v: code [%d][%d] = %#02x, want %#02x", tc, tk, k, a.Codes[tk*tc.cols+k], want)
					}
				}
			}
		}
		deq, err := a.Dequantize()
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range x {
			s := a.Scales[(k/tc.cols)*g+(k%tc.cols)/BlockSize]
			if d := math.Abs(float64(deq[k] - v)); d > (math.Abs(float64(v))/16+float64(s)/1024)*(1+1e-6) {
				t.Fatalf("%v: x %d = %v dequantizes to %v", tc, k, v, deq[k])
			}
		}
	}
}

func TestQuantizeActivationsErrors(t *testing.T) {
	x := make([]float32, 2*130)
	x[259] = float32(math.NaN())
	if _, err := QuantizeActivations(x, 2, 130, BlockSize); err == nil || !strings.Contains(err.Error(), "x[1][129] is NaN") {
		t.Errorf("NaN input: err = %v", err)
	}
	if _, err := QuantizeActivations(x, 3, 130, BlockSize); err == nil || !strings.Contains(err.Error(), "260 values for shape [3, 130]") {
		t.Errorf("short input: err = %v", err)
	}
	if _, err := QuantizeActivations(x, 2, 130, 0); err == nil {
		t.Error("group 0 accepted")
	}
	if _, err := (&Activations{Tokens: 1, Cols: 2, Group: 128, Codes: []uint8{0, 0}, Scales: []float32{0}}).Dequantize(); err == nil {
		t.Error("a zero scale dequantizes")
	}
}
