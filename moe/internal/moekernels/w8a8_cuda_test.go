package moekernels

import (
	"fmt"
	"math"
	"testing"

	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/kernels"
)

// The CUDA tests of moe_w8a8.cu: they skip where the CUDA backend does not
// open or the GPU is not compute capability 9.0 (the wgmma tiles are
// compiled for sm_90a only), and say which device ran.

// cudaW8A8Device opens the CUDA backend's device 0, or skips unless it is
// compute capability 9.0.
func cudaW8A8Device(t testing.TB) *device {
	t.Helper()
	d := cudaTestDevice(t)
	if info := d.dev.Info(); info.ComputeMajor != 9 || info.ComputeMinor != 0 {
		t.Skipf("cuda device %s is compute capability %d.%d; the w8a8 tiles need 9.0 (sm_90a wgmma)", info.Name, info.ComputeMajor, info.ComputeMinor)
	}
	return d
}

// w8a8Shapes are the expert shapes of the CUDA test: DeepSeek-V2-Lite's and
// one with partial 128-blocks in H and I.
var w8a8Shapes = []fp8Shape{
	{"deepseek-v2-lite", 64, 2048, 1408, 6},
	{"partial", 16, 2000, 720, 4}, // 15.6 blocks of H, 5.6 of I
}

// TestW8A8CUDA runs both w8a8 tiles on the GPU at 1, 64 and 300 tokens of
// w8a8Shapes, each with two routings (fp8MMAWeights.batch: expert 0 gets
// every other token, the last expert none; w8a8Skewed: every token to the
// same K experts, the others empty), and compares them with their Go twins:
// bit for bit on exactly summable data (integer codes: the tensor core's
// block sums equal the twin's, so the scaling, order, epilogue and row
// mapping are checked to the bit), within 1e-2 (max|d|/max|twin|) on
// quantized random data, where the tensor core sums each block in its own
// order and precision (the test logs how many elements differ).
func TestW8A8CUDA(t *testing.T) {
	w8a8CheckDevice(t, cudaW8A8Device(t), w8a8Shapes, []int{1, 64, 300})
}

// TestW8A8Harness runs TestW8A8CUDA's comparison with a second CPU device
// in the GPU's place at a small size (the twins against themselves), so that
// its bookkeeping is tested without a GPU.
func TestW8A8Harness(t *testing.T) {
	w8a8CheckDevice(t, newTestDevice(t), []fp8Shape{{"small partial", 5, 272, 144, 2}}, []int{1, 70})
}

// w8a8Skewed returns a batch of T tokens through w that all pick experts 0
// .. K-1 (in a rotating order): every other expert is empty.
func w8a8Skewed(w *fp8MMAWeights, T, K int, seed uint64) *fp8MMACase {
	c := w.batch(T, K, seed)
	for t := range T {
		for k := range K {
			c.idx[t*K+k] = int32((t + k) % K)
		}
	}
	return c
}

func w8a8CheckDevice(t *testing.T, dev *device, shapes []fp8Shape, tokens []int) {
	for si, sh := range shapes {
		for _, exact := range []bool{true, false} {
			w := newW8A8Weights(sh.E, sh.H, sh.I, exact, uint64(200+si))
			cpu := newTestDevice(t)
			gw, cw := w.upload(t, dev), w.upload(t, cpu)
			for _, T := range tokens {
				for ri, c := range []*fp8MMACase{w.batch(T, sh.K, uint64(1000*si+T)), w8a8Skewed(w, T, sh.K, uint64(T))} {
					for _, tile := range W8A8Gemms {
						name := fmt.Sprintf("%s/exact=%v/T=%d/routing%d/%s", sh.name, exact, T, ri, tile.Name())
						in := c.w8a8Inputs(tile.BM)
						want := c.w8a8Run(t, cpu, cw, in, tile)
						got := c.w8a8Run(t, dev, gw, in, tile)
						diff := countDiff(got, want)
						rel := relErr(bf16s64(got), bf16s64(want))
						switch {
						case exact && diff > 0:
							i := 0
							for got[i] == want[i] {
								i++
							}
							t.Errorf("%s: %d of %d elements differ from the twin (relative %.3g); first %d: %#04x, twin %#04x", name, diff, len(got), rel, i, got[i], want[i])
						case rel > 1e-2:
							t.Errorf("%s: max|d|/max|twin| = %.3g, want <= 1e-2 (%d of %d elements differ)", name, rel, diff, len(got))
						case !exact:
							t.Logf("%s: %d of %d elements differ from the twin, relative %.3g", name, diff, len(got), rel)
						}
					}
				}
			}
		}
	}
}

// TestFP8QuantCUDA runs gpuctx_moe_fp8_quant on the GPU and compares codes
// and scales with its twin bit for bit: rows of 2048 (whole groups), 1408
// and 2000 columns (a partial last group), values over many binades, a
// group of zeros, and 3000 rows (several hundred blocks).
func TestFP8QuantCUDA(t *testing.T) {
	fp8QuantCheck(t, cudaW8A8Device(t), []int{2048, 1408, 2000}, 3000)
}

// TestFP8QuantHarness is TestFP8QuantCUDA's comparison on a second CPU
// device.
func TestFP8QuantHarness(t *testing.T) {
	fp8QuantCheck(t, newTestDevice(t), []int{400}, 9)
}

func fp8QuantCheck(t *testing.T, dev *device, widths []int, R int) {
	cpu := newTestDevice(t)
	r := lcg(5)
	for _, K := range widths {
		x := make([]uint16, R*K)
		for i := range x {
			x[i] = half.BF16(float32(math.Ldexp(r.next(), int(uint64(r)>>40%40)-20)))
		}
		for k := 128; k < 256; k++ {
			x[k] = 0
		}
		G := (K + 127) / 128
		var res [2][]byte
		for i, d := range []*device{cpu, dev} {
			codes, scales := upload(t, d, make([]byte, R*K)), upload(t, d, make([]byte, 4*R*G))
			a := fp8QuantArgs{X: upload(t, d, asBytes(x)), Codes: codes, Scales: scales, R: int32(R), K: int32(K)}
			if err := fp8Launch(t, d, FP8QuantName, [2]int{FP8QuantBlocks(R, K), 1}, FP8QuantThreads, 0, kernels.Args(&a)...); err != nil {
				t.Fatalf("K=%d: %v", K, err)
			}
			res[i] = append(download(t, d, codes, R*K), download(t, d, scales, 4*R*G)...)
		}
		if n := countDiffBytes(res[0][:R*K], res[1][:R*K]); n > 0 {
			t.Errorf("K=%d: %d of %d codes differ from the twin", K, n, R*K)
		}
		if n := countDiffBytes(res[0][R*K:], res[1][R*K:]); n > 0 {
			t.Errorf("K=%d: %d scale bytes of %d differ from the twin", K, n, 4*R*G)
		}
	}
}

func countDiffBytes(a, b []byte) int {
	n := 0
	for i := range a {
		if a[i] != b[i] {
			n++
		}
	}
	return n
}
