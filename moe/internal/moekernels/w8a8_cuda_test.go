package moekernels

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/gpuctx/gpuctx"
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

// w8a8Shapes are the expert shapes of the CUDA test: DeepSeek-V2-Lite's,
// one with partial 128-blocks in H and I, and one of five K blocks, fewer
// than the 128-row persistent tiles' six stages, so that their stage ring wraps
// within a tile and across tiles. At 64 and 300 tokens each has more tiles
// than an H200 has SMs: a persistent block runs several.
var w8a8Shapes = []fp8Shape{
	{"deepseek-v2-lite", 64, 2048, 1408, 6},
	{"partial", 16, 2000, 720, 4}, // 15.6 blocks of H, 5.6 of I
	{"short K", 8, 640, 1408, 2},
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
						// A subtest per case, so that -run can pick tiles.
						t.Run(name, func(t *testing.T) { w8a8CheckCase(t, c, cpu, dev, cw, gw, tile, exact) })
					}
				}
			}
		}
	}
}

// w8a8CheckCase runs one case of w8a8CheckDevice: tile on dev against its
// twin on cpu, bit for bit on exact data, within 1e-2 otherwise.
func w8a8CheckCase(t *testing.T, c *fp8MMACase, cpu, dev *device, cw, gw fp8WeightPtrs, tile W8A8Gemm, exact bool) {
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
		t.Errorf("%d of %d elements differ from the twin (relative %.3g); first %d: %#04x, twin %#04x", diff, len(got), rel, i, got[i], want[i])
	case rel > 1e-2:
		t.Errorf("max|d|/max|twin| = %.3g, want <= 1e-2 (%d of %d elements differ)", rel, diff, len(got))
	case !exact:
		t.Logf("%d of %d elements differ from the twin, relative %.3g", diff, len(got), rel)
	}
}

// TestFP8QuantCUDA runs gpuctx_moe_fp8_quant on the GPU and compares codes
// and scales with its twin bit for bit: rows of 2048 (whole groups), 1408
// and 2000 columns (a partial last group), values over many binades, a
// group of zeros, and 3000 rows (more (row, group) items than the grid's
// threads take at once), over all rows and bounded by npost (fp8QuantCheck).
func TestFP8QuantCUDA(t *testing.T) {
	fp8QuantCheck(t, cudaW8A8Device(t), []int{2048, 1408, 2000}, 3000)
}

// TestFP8QuantHarness is TestFP8QuantCUDA's comparison on a second CPU
// device.
func TestFP8QuantHarness(t *testing.T) {
	fp8QuantCheck(t, newTestDevice(t), []int{400}, 9)
}

// fp8QuantCheck quantizes R rows of each width on dev and on the CPU twin,
// every row (bounded 0, npost not read: it holds 1) and bounded by npost
// below R, above R and negative, into codes and scales filled with a marker
// byte, and compares both bit for bit with the twin's and with the rule: the
// rows below min(R, npost) quantized, the others untouched.
func fp8QuantCheck(t *testing.T, dev *device, widths []int, R int) {
	const marker = 0xa5
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
		copy(x[K:K+128], quantMidpointGroup())
		G := (K + 127) / 128
		for _, tc := range []struct {
			bounded, npost int32
			rows           int // the rows quantized
		}{
			{0, 1, R}, {1, int32(R - R/3), R - R/3}, {1, int32(R + 5), R}, {1, -3, 0},
		} {
			var res [2][]byte
			for i, d := range []*device{cpu, dev} {
				fill := func(n int) Ptr { return upload(t, d, bytes.Repeat([]byte{marker}, n)) }
				codes, scales := fill(R*K), fill(4*R*G)
				a := fp8QuantArgs{X: upload(t, d, asBytes(x)), Codes: codes, Scales: scales,
					Npost: upload(t, d, asBytes([]int32{tc.npost})), R: int32(R), K: int32(K), Bounded: tc.bounded}
				if err := fp8Launch(t, d, FP8QuantName, [2]int{FP8QuantBlocks(R, K), 1}, FP8QuantThreads, 0, kernels.Args(&a)...); err != nil {
					t.Fatalf("K=%d %+v: %v", K, tc, err)
				}
				res[i] = append(download(t, d, codes, R*K), download(t, d, scales, 4*R*G)...)
			}
			if n := countDiffBytes(res[0][:R*K], res[1][:R*K]); n > 0 {
				t.Errorf("K=%d %+v: %d of %d codes differ from the twin", K, tc, n, R*K)
			}
			if n := countDiffBytes(res[0][R*K:], res[1][R*K:]); n > 0 {
				t.Errorf("K=%d %+v: %d scale bytes of %d differ from the twin", K, tc, n, 4*R*G)
			}
			checkQuantRows(t, fmt.Sprintf("K=%d %+v", K, tc), res[1][:R*K], res[1][R*K:], x, K, tc.rows, marker)
		}
	}
}

// quantMidpointGroup returns a group of 128 bf16 values whose quotients by
// their scale are exactly E4M3 rounding midpoints: 784 (so s = 784/448 =
// 1.75, exact, while 1/s is rounded up by 0.75 of its half ulp) then 1.75 m
// for midpoints m between E4M3 values from 2^-6 up, both signs, so that a
// quotient computed as v * (1/s) lands off the midpoint and rounds the wrong
// way unless the quantizer divides there (TestQuantReciprocalGuard).
func quantMidpointGroup() []uint16 {
	g := []uint16{half.BF16(784)}
	for e := -6; e <= 8 && len(g) < 127; e++ {
		for c := 8; c < 16 && len(g) < 127; c++ { // m = (c + 1/2) / 8 * 2^e, between c/8 and (c+1)/8 times 2^e
			m := math.Ldexp(float64(2*c+1), e-4)
			v := half.BF16(float32(1.75 * m))
			if float64(half.FromBF16(v)) != 1.75*m {
				panic(fmt.Sprintf("quantMidpointGroup: 1.75 * %g is not a bf16 value", m))
			}
			g = append(g, v, v|0x8000)
		}
	}
	for len(g) < 128 {
		g = append(g, half.BF16(1))
	}
	return g
}

// checkQuantRows checks the quantizer's output codes and scales (as bytes)
// of rows of K columns against QuantizeRow for the first n rows of x and the
// marker byte for the rest.
func checkQuantRows(t *testing.T, what string, codes, scales []byte, x []uint16, K, n int, marker byte) {
	t.Helper()
	G := (K + 127) / 128
	R := len(codes) / K
	wc, ws := make([]uint8, K), make([]float32, G)
	for row := range R {
		gc, gs := codes[row*K:(row+1)*K], scales[4*row*G:4*(row+1)*G]
		if row >= n {
			if slices.ContainsFunc(gc, func(c byte) bool { return c != marker }) || slices.ContainsFunc(gs, func(c byte) bool { return c != marker }) {
				t.Errorf("%s: row %d (past the %d quantized) was written", what, row, n)
				return
			}
			continue
		}
		QuantizeRow(wc, ws, x[row*K:(row+1)*K])
		if !bytes.Equal(gc, wc) || !bytes.Equal(gs, asBytes(ws)) {
			t.Errorf("%s: row %d differs from QuantizeRow", what, row)
			return
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

// w8a8Chain returns the launch of the w8a8 form with tiles up and down on a
// benchmark batch, weight set set: gpuctx_moe_fp8_quant of x, the up tile,
// the quantizer over act's cap rows, the down tile (as moe's fusedW8A8
// queues them), and the four launches on their own.
func w8a8Chain(tb testing.TB, d *device, w *fp8BenchWeights, bb *fp8BenchBatch, H, I, K int, up, down W8A8Gemm) (chain func(*gpuctx.Stream, int) error, parts []func(*gpuctx.Stream, int) error) {
	pl := bb.plans[up.BM]
	kb := func(n int) int { return (n + 127) / 128 }
	alloc := func(n int) Ptr {
		p, err := d.Alloc(n)
		if err != nil {
			tb.Fatalf("Alloc(%d): %v", n, err)
		}
		return p
	}
	xq, xs, aq, as := alloc(bb.T*H), alloc(4*bb.T*kb(H)), alloc(pl.cap*I), alloc(4*pl.cap*kb(I))
	T, TK := int32(bb.T), int32(bb.TK)
	gux, guy := up.Grid(I, pl.cap, d.dev.Info().SMCount)
	gdx, gdy := down.Grid(H, pl.cap, d.dev.Info().SMCount)
	for _, l := range []struct {
		name    string
		grid    [2]int
		threads int
		smem    int
		args    func(set int) []any
	}{
		{FP8QuantName, [2]int{FP8QuantBlocks(bb.T, H), 1}, FP8QuantThreads, 0, func(int) []any { return []any{bb.x, xq, xs, pl.npost, T, int32(H), int32(0)} }},
		{up.Name(), [2]int{gux, guy}, up.Threads(), up.SmemBytes(), func(set int) []any {
			return []any{xq, xs, w.gu[set], w.gus[set], pl.sorted, pl.blockExpert, pl.npost, bb.act, TK, int32(K), int32(H), int32(I)}
		}},
		{FP8QuantName, [2]int{FP8QuantBlocks(pl.cap, I), 1}, FP8QuantThreads, 0, func(int) []any { return []any{bb.act, aq, as, pl.npost, int32(pl.cap), int32(I), int32(1)} }},
		{down.Name(), [2]int{gdx, gdy}, down.Threads(), down.SmemBytes(), func(set int) []any {
			return []any{aq, as, w.down[set], w.downs[set], pl.sorted, pl.blockExpert, pl.npost, bb.out, TK, int32(H), int32(I)}
		}},
	} {
		f, err := launcher(d, l.name, l.grid, l.threads, l.smem, l.args)
		if err != nil {
			tb.Fatalf("%s: %v", l.name, err)
		}
		parts = append(parts, f)
	}
	chain = func(s *gpuctx.Stream, set int) error {
		for _, f := range parts {
			if err := f(s, set); err != nil {
				return err
			}
		}
		return nil
	}
	return chain, parts
}

// TestW8A8BenchHarness runs BenchmarkW8A8Expert's chain on the CPU backend
// at a small size (the twins check every launch's arguments), and checks
// that the benchmark times real work: its activations are not zeros (zero
// gate sums send every SwiGLU division down the divider's slow path, and
// the quantizer and the tensor cores then have nothing to do), so the up
// kernels write activations that are not all zeros either.
func TestW8A8BenchHarness(t *testing.T) {
	d := newTestDevice(t)
	const T, H, I = 70, 256, 128
	w := newFP8BenchWeights(t, d, 4, H, I, 1)
	bb := newFP8BenchBatch(t, d, 4, H, I, 2, T)
	tm := newFP8Timer(t, d, 1, 1, 1)
	for _, p := range w8a8Pairs() {
		chain, parts := w8a8Chain(t, d, w, bb, H, I, 2, p[0], p[1])
		if len(parts) != 4 {
			t.Fatalf("%d launches in the chain, want 4", len(parts))
		}
		if ts := tm.perCall(t, chain); len(ts) != 1 {
			t.Fatalf("perCall: %v", ts)
		}
	}
	nonzero := func(b []byte) int {
		n := 0
		for _, v := range b {
			if v != 0 {
				n++
			}
		}
		return n
	}
	if x := download(t, d, bb.x, 2*T*H); nonzero(x) < len(x)/2 {
		t.Errorf("the benchmark's activations x: %d of %d bytes nonzero, want most", nonzero(x), len(x))
	}
	if a := download(t, d, bb.act, 2*bb.plans[8].cap*I); nonzero(a) == 0 {
		t.Error("the up kernels wrote only zeros to act")
	}
}

// BenchmarkW8A8Expert times the routed experts of DeepSeek-V2-Lite (H=2048,
// I=1408, E=64, top-6) at 1, 8, 64, 256, 1024, 4096 and 8192 tokens, of
// Qwen3-30B-A3B (H=2048, I=768, E=128, top-8) at 1, 8, 64 and 256 and of
// DeepSeek-V3 (H=7168, I=2048, E=256, top-8) at 64 and 1024 tokens, on a GPU of
// compute capability 9.0 (random routing, two weight sets rotating): the
// fastest w8a8 chain (quantize x, up tile, quantize act, down tile; every
// pair of w8a8Pairs) against the fastest bf16 tile pair and the fastest w8a16
// pair (BenchmarkFP8Expert's sweeps). It logs each w8a8 launch's time and
// reports microseconds per call and bf16/w8a8 (the issue asks for >= 1.5 at
// 4096 tokens, layer-wide).
func BenchmarkW8A8Expert(b *testing.B) {
	d := cudaW8A8Device(b)
	for _, sc := range []struct {
		sh     fp8Shape
		tokens []int
	}{
		{fp8BenchShapes[0], []int{1, 8, 64, 256, 1024, 4096, 8192}},
		{fp8BenchShapes[1], []int{1, 8, 64, 256}},
		{fp8BenchShapes[2], []int{64, 1024}},
	} {
		benchW8A8Shape(b, d, sc.sh, sc.tokens)
	}
}

func benchW8A8Shape(b *testing.B, d *device, sh fp8Shape, tokens []int) {
	const nsets = 2
	w := newFP8BenchWeights(b, d, sh.E, sh.H, sh.I, nsets)
	for _, T := range tokens {
		b.Run(fmt.Sprintf("%s/T=%d", sh.name, T), func(b *testing.B) {
			bb := newFP8BenchBatch(b, d, sh.E, sh.H, sh.I, sh.K, T)
			tm := newFP8Timer(b, d, nsets, 3, 10)
			var chain func(*gpuctx.Stream, int) error
			best := math.Inf(1)
			for _, p := range w8a8Pairs() { // the fastest of the pairs, by their launches' sum
				c, parts := w8a8Chain(b, d, w, bb, sh.H, sh.I, sh.K, p[0], p[1])
				ts := tm.perCall(b, parts...)
				b.Logf("T=%d w8a8 %s + %s: quant x %.1f us, up %.1f us, quant act %.1f us, down %.1f us", T, p[0].Tag(), p[1].Tag(), ts[0], ts[1], ts[2], ts[3])
				if sum := ts[0] + ts[1] + ts[2] + ts[3]; sum < best {
					chain, best = c, sum
				}
			}
			fu, fd, bu, bd := fp8BenchPairs(b, d, tm, w, bb, sh.H, sh.I, sh.K)
			pair := func(up, down fp8Kernel) func(*gpuctx.Stream, int) error {
				return func(s *gpuctx.Stream, set int) error {
					if err := up.launch(s, set); err != nil {
						return err
					}
					return down.launch(s, set)
				}
			}
			tm.warmup, tm.iters = 0, 20
			var w8, bf, w16 float64
			n := 0
			for b.Loop() {
				t := tm.perCall(b, chain, pair(bu, bd), pair(fu, fd))
				w8, bf, w16 = w8+t[0], bf+t[1], w16+t[2]
				n++
			}
			w8, bf, w16 = w8/float64(n), bf/float64(n), w16/float64(n)
			flop := 2 * float64(bb.TK) * float64(3*sh.H*sh.I)
			b.ReportMetric(w8, "w8a8-us/call")
			b.ReportMetric(bf, "bf16-us/call")
			b.ReportMetric(w16, "w8a16-us/call")
			b.ReportMetric(bf/w8, "bf16/w8a8")
			b.ReportMetric(flop/w8/1e6, "w8a8-TFLOP/s")
		})
	}
}

// w8a8Pairs returns the up and down tiles of W8A8Gemms in pairs of the same
// kind (plain, or persistent with the same producers).
func w8a8Pairs() [][2]W8A8Gemm {
	var out [][2]W8A8Gemm
	for _, u := range W8A8Gemms {
		for _, d := range W8A8Gemms {
			if u.Up && !d.Up && u.Producers == d.Producers && u.Trans == d.Trans && u.BM == d.BM {
				out = append(out, [2]W8A8Gemm{u, d})
			}
		}
	}
	return out
}
