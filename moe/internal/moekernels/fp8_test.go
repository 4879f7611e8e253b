package moekernels

import (
	"math"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/kernels"
	"github.com/gpuctx/gpuctx/moe/fp8"
)

// fp8Case is one grouped w8a16 GEMM: E experts [N, K] quantized in 128x128
// blocks, and the plan's rows of x.
type fp8Case struct {
	E, N, K         int
	counts, offsets []int32
	weights         []*fp8.Weight
	x               []float32 // [rows, K], bf16 values
}

func newFP8Case(t *testing.T, E, N, K int, counts []int32) *fp8Case {
	t.Helper()
	c := &fp8Case{E: E, N: N, K: K, counts: counts, offsets: make([]int32, E+1)}
	for e := range E {
		c.offsets[e+1] = c.offsets[e] + counts[e]
	}
	r := lcg(uint64(E*N + K))
	for range E {
		v := r.vals(N * K)
		w := make([]float32, N*K)
		for i := range w {
			// Magnitudes differ per block, so a scale applied to the wrong
			// block shows.
			w[i] = float32(v[i] * math.Pow(3, float64((i/K)/128+2*((i%K)/128))))
		}
		q, err := fp8.Quantize(w, N, K, [2]int{fp8.BlockSize, fp8.BlockSize})
		if err != nil {
			t.Fatal(err)
		}
		c.weights = append(c.weights, q)
	}
	for _, v := range r.vals(int(c.offsets[E]) * K) {
		c.x = append(c.x, half.FromBF16(half.BF16(float32(4*v))))
	}
	return c
}

// run launches gpuctx_moe_fp8_w8a16 on the CPU backend and returns y as
// float32 ([rows, N]).
func (c *fp8Case) run(t *testing.T, d *device, bf16 bool) []float32 {
	t.Helper()
	var codes []uint8
	var scales []float32
	for _, w := range c.weights {
		codes, scales = append(codes, w.Codes...), append(scales, w.Scales...)
	}
	rows := int(c.offsets[c.E])
	var x, y Ptr
	flag := int32(0)
	if bf16 {
		flag = 1
		x, y = upload(t, d, asBytes(half.BF16s(c.x))), alloc(t, d, max(2*rows*c.N, 4))
	} else {
		x, y = upload(t, d, asBytes(c.x)), alloc(t, d, max(4*rows*c.N, 4))
	}
	a := fp8W8A16Args{X: x, W: upload(t, d, codes), Ws: upload(t, d, asBytes(scales)),
		Counts: upload(t, d, asBytes(c.counts)), Offsets: upload(t, d, asBytes(c.offsets)), Y: y,
		E: int32(c.E), N: int32(c.N), K: int32(c.K), BF16: flag}
	if err := launchSync(t, d, "gpuctx_moe_fp8_w8a16", kernels.Args(&a)...); err != nil {
		t.Fatal(err)
	}
	if !bf16 {
		return fromBytes[float32](download(t, d, y, 4*rows*c.N))
	}
	out := make([]float32, rows*c.N)
	for i, h := range fromBytes[uint16](download(t, d, y, 2*rows*c.N)) {
		out[i] = half.FromBF16(h)
	}
	return out
}

// TestFP8W8A16Twin checks the twin of gpuctx_moe_fp8_w8a16 against
// moe/fp8.GemmW8A16 run expert by expert on the plan's rows: bit for bit in
// f32 (the same order), and after the same bf16 rounding in bf16; and against
// a float64 GEMM on the dequantized weights within the 1e-2. Partial
// blocks in N and K, and an expert with no rows, included.
func TestFP8W8A16Twin(t *testing.T) {
	for _, tc := range []struct {
		name    string
		E, N, K int
		counts  []int32
	}{
		{"partial blocks, an empty expert", 3, 136, 300, []int32{2, 0, 3}},
		{"full blocks, one expert", 1, 256, 256, []int32{4}},
		{"tiny", 2, 3, 5, []int32{1, 1}},
	} {
		c := newFP8Case(t, tc.E, tc.N, tc.K, tc.counts)
		for _, bf16 := range []bool{false, true} {
			t.Run(tc.name+map[bool]string{false: " f32", true: " bf16"}[bf16], func(t *testing.T) {
				d := newTestDevice(t)
				got := c.run(t, d, bf16)
				var ref, ref64 []float64
				for e, w := range c.weights {
					n := int(c.counts[e])
					if n == 0 {
						continue
					}
					xe := c.x[int(c.offsets[e])*c.K : int(c.offsets[e+1])*c.K]
					ye := make([]float32, n*c.N)
					if err := fp8.GemmW8A16(ye, xe, n, w); err != nil {
						t.Fatal(err)
					}
					deq, err := w.Dequantize()
					if err != nil {
						t.Fatal(err)
					}
					for r := range n {
						for j := range c.N {
							v := ye[r*c.N+j]
							if bf16 {
								v = half.FromBF16(half.BF16(v))
							}
							ref = append(ref, float64(v))
							var s float64
							for k := range c.K {
								s += float64(xe[r*c.K+k]) * float64(deq[j*c.K+k])
							}
							ref64 = append(ref64, s)
						}
					}
				}
				got64 := make([]float64, len(got))
				for i, v := range got {
					got64[i] = float64(v)
					if float64(v) != ref[i] {
						t.Fatalf("y[%d][%d] = %v, fp8.GemmW8A16 gives %v", i/c.N, i%c.N, v, ref[i])
					}
				}
				if e := relErr(got64, ref64); e > 1e-2 {
					t.Errorf("max|d|/max|ref| = %.3g against float64, want <= 1e-2", e)
				}
			})
		}
	}
}

// TestFP8W8A16Errors: bad dimensions, a plan whose rows run past its end
// and weights past their buffer are errors naming them (each case on a device
// of its own: a failed kernel loses its device).
func TestFP8W8A16Errors(t *testing.T) {
	for _, tc := range []struct {
		name         string
		E, N, K      int32
		counts, offs []int32
		want         string
	}{
		{"no experts", 0, 4, 4, []int32{3}, []int32{0, 3}, "dimensions E=0"},
		{"plan out of range", 1, 4, 4, []int32{3}, []int32{0, 2}, "expert 0: rows [0, 3) outside the plan's 2 rows"},
		{"weights past the buffer", 1, 128, 128, []int32{3}, []int32{0, 3}, "w"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDevice(t)
			buf := alloc(t, d, 4096)
			a := fp8W8A16Args{X: buf, W: buf, Ws: buf, Counts: upload(t, d, asBytes(tc.counts)), Offsets: upload(t, d, asBytes(tc.offs)),
				Y: buf, E: tc.E, N: tc.N, K: tc.K}
			err := launchSync(t, d, "gpuctx_moe_fp8_w8a16", kernels.Args(&a)...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want %q", err, tc.want)
			}
		})
	}
}
