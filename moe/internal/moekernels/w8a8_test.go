package moekernels

import (
	"fmt"
	"math"
	"math/big"
	"slices"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/kernels"
	"github.com/gpuctx/gpuctx/moe/fp8"
)

// w8a8IntCodes are the E4M3 codes of the integers -4 .. 4: products of two
// of them are integers of magnitude at most 16, and a 128-column block's sum
// at most 2048 = 2^11, exact in any order and in the tensor core's reduced
// internal precision (it keeps more than 11 bits below the largest addend).
var w8a8IntCodes = func() []uint8 {
	var cs []uint8
	for v := -4; v <= 4; v++ {
		cs = append(cs, fp8.E4M3(float32(v)))
	}
	return cs
}()

// newW8A8Weights returns random weights: every finite code, or for exact
// data w8a8IntCodes; random block scales either way.
func newW8A8Weights(E, H, I int, exact bool, seed uint64) *fp8MMAWeights {
	w := newFP8MMAWeights(E, H, I, false, seed)
	w.exact = exact
	if exact {
		r := lcg(seed + 7)
		for _, ws := range [][]*fp8.Weight{w.gate, w.up, w.down} {
			for _, m := range ws {
				for i := range m.Codes {
					m.Codes[i] = w8a8IntCodes[int(uint64(r)>>33)%len(w8a8IntCodes)]
					r.next()
				}
			}
		}
	}
	return w
}

// w8a8Inputs are the quantized activations of a case for tiles of BM rows:
// xq [T][H] codes and xs [T][ceil(H/128)] scales for the up kernel, aq
// [cap][I] and as [cap][ceil(I/128)] for the down kernel. Exact data has
// random w8a8IntCodes and random scales; general data is the quantizer's
// twin (QuantizeRow) of the case's x and act rows.
type w8a8Inputs struct {
	xq, aq []uint8
	xs, as []float32
}

func (c *fp8MMACase) w8a8Inputs(BM int) w8a8Inputs {
	const B = fp8.BlockSize
	kh, ki := (c.H+B-1)/B, (c.I+B-1)/B
	act := c.actRows(BM)
	cp := len(act) / c.I
	in := w8a8Inputs{xq: make([]uint8, c.T*c.H), xs: make([]float32, c.T*kh), aq: make([]uint8, cp*c.I), as: make([]float32, cp*ki)}
	if c.exact {
		r := lcg(uint64(c.T*c.H + BM))
		for _, q := range [][]uint8{in.xq, in.aq} {
			for i := range q {
				q[i] = w8a8IntCodes[int(uint64(r)>>33)%len(w8a8IntCodes)]
				r.next()
			}
		}
		for _, s := range [][]float32{in.xs, in.as} {
			for i := range s {
				s[i] = float32(math.Ldexp(1.5+r.next()/2, -6-i%5))
			}
		}
		return in
	}
	for t := range c.T {
		QuantizeRow(in.xq[t*c.H:(t+1)*c.H], in.xs[t*kh:(t+1)*kh], c.x[t*c.H:(t+1)*c.H])
	}
	for p := range cp {
		QuantizeRow(in.aq[p*c.I:(p+1)*c.I], in.as[p*ki:(p+1)*ki], act[p*c.I:(p+1)*c.I])
	}
	return in
}

// w8a8Run runs w8a8 tile c on d over the case (inputs in, weights wp) and
// returns its bf16 output: act [cap][I] for an up tile (every row of the
// sort, padding rows zero), out [TK][H] for a down tile.
func (c *fp8MMACase) w8a8Run(t testing.TB, d *device, wp fp8WeightPtrs, in w8a8Inputs, tile W8A8Gemm) []uint16 {
	t.Helper()
	sorted, blockExpert, npost, cp := c.align(tile.BM)
	TK := len(c.idx)
	sp, bp := upload(t, d, asBytes(sorted)), upload(t, d, asBytes(blockExpert))
	np := upload(t, d, asBytes([]int32{npost}))
	var err error
	var out Ptr
	var n int
	if tile.Up {
		n = cp * c.I
		out = upload(t, d, make([]byte, 2*n))
		a := w8a8UpArgs{Xq: upload(t, d, in.xq), Xs: upload(t, d, asBytes(in.xs)), Gu: wp.gu, Gus: wp.gus,
			Sorted: sp, BlockExpert: bp, Npost: np, Act: out, TK: int32(TK), K: int32(c.K), H: int32(c.H), I: int32(c.I)}
		gx, gy := tile.Grid(c.I, cp, d.dev.Info().SMCount)
		err = fp8Launch(t, d, tile.Name(), [2]int{gx, gy}, tile.Threads(), tile.SmemBytes(), kernels.Args(&a)...)
	} else {
		n = TK * c.H
		out = upload(t, d, make([]byte, 2*max(n, 1)))
		a := w8a8DownArgs{Aq: upload(t, d, in.aq), As: upload(t, d, asBytes(in.as)), Down: wp.down, Downs: wp.downs,
			Sorted: sp, BlockExpert: bp, Npost: np, Out: out, TK: int32(TK), H: int32(c.H), I: int32(c.I)}
		gx, gy := tile.Grid(c.H, cp, d.dev.Info().SMCount)
		err = fp8Launch(t, d, tile.Name(), [2]int{gx, gy}, tile.Threads(), tile.SmemBytes(), kernels.Args(&a)...)
	}
	if err != nil {
		t.Fatalf("%s: %v", tile.Name(), err)
	}
	return fromBytes[uint16](download(t, d, out, 2*n))
}

// w8a8Reference returns the float64 value of every output of tile (as
// w8a8Run returns them) from the dequantized inputs and weights: act rows
// silu(g)*u for an up tile (zeros for padding rows), out rows for a down
// tile.
func (c *fp8MMACase) w8a8Reference(in w8a8Inputs, tile W8A8Gemm) []float64 {
	const B = fp8.BlockSize
	kh, ki := (c.H+B-1)/B, (c.I+B-1)/B
	sorted, _, _, _ := c.align(tile.BM)
	TK := len(c.idx)
	deq := func(q []uint8, s []float32) []float32 {
		out := make([]float32, len(q))
		for k := range q {
			out[k] = fp8.FromE4M3(q[k]) * s[k/B]
		}
		return out
	}
	if tile.Up {
		var ref []float64
		for _, a := range sorted {
			if int(a) >= TK {
				ref = append(ref, make([]float64, c.I)...)
				continue
			}
			tk, e := int(a)/c.K, c.idx[a]
			xr := deq(in.xq[tk*c.H:(tk+1)*c.H], in.xs[tk*kh:(tk+1)*kh])
			for i := range c.I {
				g, u := fp8Dot64(xr, c.gate[e], i), fp8Dot64(xr, c.up[e], i)
				ref = append(ref, g/(1+math.Exp(-g))*u)
			}
		}
		return ref
	}
	ref := make([]float64, TK*c.H)
	for p, a := range sorted {
		if int(a) >= TK {
			continue
		}
		ar := deq(in.aq[p*c.I:(p+1)*c.I], in.as[p*ki:(p+1)*ki])
		for h := range c.H {
			ref[int(a)*c.H+h] = fp8Dot64(ar, c.down[c.idx[a]], h)
		}
	}
	return ref
}

// TestW8A8Twin checks the twins of the w8a8 tiles on the CPU backend
// against a float64 GEMM on the dequantized activations and weights within
// 1e-2 (max|d|/max|ref|): partial 128-blocks in N and K, an expert without
// rows, one with more rows than a tile, padding rows (zeros in act), general
// and exactly summable data.
func TestW8A8Twin(t *testing.T) {
	for _, tc := range []struct {
		name          string
		E, H, I, T, K int
	}{
		{"partial blocks", 4, 400, 208, 70, 2},
		{"full blocks", 3, 256, 128, 5, 2},
		{"one partial block", 2, 16, 16, 3, 1},
	} {
		for _, exact := range []bool{false, true} {
			c := newW8A8Weights(tc.E, tc.H, tc.I, exact, uint64(tc.H*tc.I)).batch(tc.T, tc.K, uint64(tc.T))
			for _, tile := range W8A8Gemms {
				t.Run(fmt.Sprintf("%s/exact=%v/%s", tc.name, exact, tile.Name()), func(t *testing.T) {
					d := newTestDevice(t)
					in := c.w8a8Inputs(tile.BM)
					got := c.w8a8Run(t, d, c.upload(t, d), in, tile)
					if e := relErr(bf16s64(got), c.w8a8Reference(in, tile)); e > 1e-2 {
						t.Errorf("max|d|/max|ref| = %.3g against float64, want <= 1e-2", e)
					}
				})
			}
		}
	}
}

// TestW8A8Dot checks W8A8Dot's order against a restatement, and that on
// exact data (w8a8IntCodes) every block sum is an integer of magnitude at
// most 2^11, which the CUDA test's bitwise comparison relies on.
func TestW8A8Dot(t *testing.T) {
	r := lcg(3)
	const K = 300 // 2.3 blocks
	x, w := make([]uint8, K), make([]uint8, K)
	xs, ws := []float32{0.5, 0.25, 3}, []float32{0.125, 7, 0.0625}
	for _, codes := range [][]uint8{fp8AllCodes, w8a8IntCodes} {
		for k := range K {
			x[k], w[k] = codes[int(uint64(r)>>33)%len(codes)], codes[int(uint64(r)>>34)%len(codes)]
			r.next()
		}
		var want float32
		for b := range 3 {
			var p float32
			var p64 float64
			for k := b * 128; k < min(b*128+128, K); k++ {
				p += float32(fp8.FromE4M3(x[k]) * fp8.FromE4M3(w[k]))
				p64 += float64(fp8.FromE4M3(x[k])) * float64(fp8.FromE4M3(w[k]))
			}
			if codes[0] == w8a8IntCodes[0] && (float64(p) != p64 || math.Abs(p64) > 2048 || p64 != math.Round(p64)) {
				t.Errorf("exact data: block %d sums to %v (float64 %v), want the same integer of magnitude <= 2048", b, p, p64)
			}
			want = exactFMA32(p, float32(xs[b]*ws[b]), want)
		}
		if got := W8A8Dot(x, xs, w, ws); math.Float32bits(got) != math.Float32bits(want) {
			t.Errorf("W8A8Dot = %v, want %v", got, want)
		}
	}
}

// TestFP8QuantTwin checks the quantizer's twin against
// fp8.QuantizeActivations (group 128) bit for bit on finite data, partial
// last group included, and its documented edge cases: a group of zeros
// gets codes 0 and scale 1e-10/448, -0 and tiny negative values code 0x80,
// NaN a NaN code, values past the scale's range saturate.
func TestFP8QuantTwin(t *testing.T) {
	r := lcg(11)
	const R, K = 5, 400
	x := make([]float32, R*K)
	for i := range x {
		x[i] = float32(math.Ldexp(r.next(), int(uint64(r)>>40%20)-10))
	}
	for k := 128; k < 256; k++ { // row 0, group 1: zeros
		x[k] = 0
	}
	h := half.BF16s(x)
	x = bf16Row(h)
	want, err := fp8.QuantizeActivations(x, R, K, fp8.BlockSize)
	if err != nil {
		t.Fatal(err)
	}
	d := newTestDevice(t)
	codes, scales := upload(t, d, make([]byte, R*K)), upload(t, d, make([]byte, 4*R*4))
	a := fp8QuantArgs{X: upload(t, d, asBytes(h)), Codes: codes, Scales: scales, Npost: upload(t, d, make([]byte, 4)), R: R, K: K}
	if err := fp8Launch(t, d, FP8QuantName, [2]int{FP8QuantBlocks(R, K), 1}, FP8QuantThreads, 0, kernels.Args(&a)...); err != nil {
		t.Fatal(err)
	}
	gc, gs := download(t, d, codes, R*K), fromBytes[float32](download(t, d, scales, 4*R*4))
	if !slices.Equal(gc, want.Codes) {
		t.Errorf("codes differ from fp8.QuantizeActivations")
	}
	for i := range gs {
		if math.Float32bits(gs[i]) != math.Float32bits(want.Scales[i]) {
			t.Errorf("scale %d = %v, fp8.QuantizeActivations %v", i, gs[i], want.Scales[i])
		}
	}
	if gs[1] != fp8QuantEps/448 || slices.ContainsFunc(gc[128:256], func(c uint8) bool { return c != 0 }) {
		t.Errorf("a group of zeros: scale %v, codes %v; want %v and zeros", gs[1], gc[128:256], fp8QuantEps/448)
	}
	edge := []uint16{half.BF16(float32(math.Copysign(0, -1))), half.BF16(-1e-30), half.BF16(float32(math.NaN())), half.BF16(100)}
	ec, es := make([]uint8, 4), make([]float32, 1)
	QuantizeRow(ec, es, edge)
	if es[0] != 100.0/448 || ec[0] != 0x80 || ec[1] != 0x80 || ec[2] != fp8.NaNE4M3 || ec[3] != fp8.MaxCodeE4M3 {
		t.Errorf("edge cases: codes %#x, scale %v; want 0x80 0x80 0x7f 0x7e, 100/448", ec, es[0])
	}
}

// TestW8A8Configs checks every w8a8 tile against moe_w8a8.cu's static
// assertions and the shared-memory limit, the generated instances, the
// registered kernels' signatures and the source's compute capability.
func TestW8A8Configs(t *testing.T) {
	src := kernels.Sources()[W8A8File]
	if src != W8A8Source() || !strings.HasPrefix(src, gridDeps+tileSource+fp8MMASource) {
		t.Errorf("%s is not the grid-dependency macros, moe_tile.cuh, moe_fp8_mma.cu, the file, then the instances", W8A8File)
	}
	if a := kernels.Archs(W8A8File); !slices.Equal(a, []int{90}) {
		t.Errorf("%s compiles for %v, want [90] (sm_90a's wgmma)", W8A8File, a)
	}
	counts, files := kernels.ParamCounts(), kernels.Files()
	want := map[string]int{FP8QuantName: 7}
	ups := 0
	for _, c := range W8A8Gemms {
		if err := c.Check(); err != nil {
			t.Error(err)
		}
		want[c.Name()] = 11
		if c.Up {
			want[c.Name()], ups = 12, ups+1
		}
		if !WaitsFirst(c.Name()) {
			t.Errorf("%s: not WaitsFirst", c.Name())
		}
	}
	// Every tile has a partner of the other kind (the same BM, sort and
	// form), so that a chain can run it.
	paired := map[W8A8Gemm]bool{}
	for _, p := range w8a8Pairs() {
		paired[p[0]], paired[p[1]] = true, true
	}
	for _, c := range W8A8Gemms {
		if !paired[c] {
			t.Errorf("w8a8 tile %s (up %v) has no partner in W8A8Gemms (same BM, producers and form)", c.Tag(), c.Up)
		}
	}
	if ups == 0 || ups == len(W8A8Gemms) {
		t.Errorf("W8A8Gemms holds %d up tiles of %d", ups, len(W8A8Gemms))
	}
	for name, n := range want {
		if counts[name] != n || files[name] != W8A8File {
			t.Errorf("%s: %d parameters in %q, want %d in %s", name, counts[name], files[name], n, W8A8File)
		}
		if !strings.Contains(src, " void "+name+"(") {
			t.Errorf("%s: no definition in %s", name, W8A8File)
		}
	}
	if !strings.Contains(src, "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") {
		t.Errorf("%s has no e4m3 wgmma of width 128", W8A8File)
	}
	if err := kernels.CheckSignatures(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []W8A8Gemm{
		{BM: 96, BN: 64, Stages: 4, Up: true},   // BM
		{BM: 128, BN: 48, Stages: 4},            // BN does not divide 128
		{BM: 128, BN: 128, Stages: 1},           // stages
		{BM: 128, BN: 128, Stages: 8, Up: true}, // shared memory
		{BM: 128, BN: 64, Stages: 4, Producers: 3, Up: true},
		{BM: 128, BN: 8, Stages: 4, Producers: 4},   // four rows per producer warp
		{BM: 128, BN: 256, Stages: 4, Producers: 2}, // 256 columns: a producer warpgroup
		{BM: 128, BN: 256, Stages: 4},               // 256 columns only persistent
	} {
		if bad.Check() == nil {
			t.Errorf("w8a8 tile %s passes Check", bad.Tag())
		}
	}
	if _, err := NewW8A8Up(newTestDevice(t).dev, W8A8Gemm{BM: 128, BN: 128, Stages: 4}); err == nil {
		t.Error("NewW8A8Up of a down tile: no error")
	}
}

// quantCodeFast is moe_w8a8.cu's w8_codes2 on one value, in Go (float32
// operations round to nearest even as the device's __fmul_rn and __frcp_rn
// do): the codes of q * (1 -+ 2^-20) with q = v * (1/s) when they agree, else
// the code of the division.
func quantCodeFast(v, s float32) uint8 {
	r := 1 / s
	q := v * r
	lo, hi := float32(1-0x1p-20), float32(1+0x1p-20)
	if a, b := quantCode(q*lo), quantCode(q*hi); a == b {
		return a
	}
	return quantCode(v / s)
}

// TestQuantReciprocalGuard checks the argument behind the quantizer's
// reciprocal (w8_codes2): over random values and scales of many binades,
// zeros, NaN, infinities and the midpoint group of quantMidpointGroup, the
// code of quantCodeFast equals the code of the exactly rounded quotient, and
// without the guard the midpoint group would not (so the group tests it).
func TestQuantReciprocalGuard(t *testing.T) {
	r := lcg(17)
	check := func(v, s float32) {
		if got, want := quantCodeFast(v, s), quantCode(v/s); got != want {
			t.Fatalf("v=%g s=%g: code %#x, the division's %#x", v, s, got, want)
		}
	}
	for range 2000000 {
		s := float32(math.Ldexp(0.5+r.next()/2, int(uint64(r)>>40%60)-30))
		v := s * float32(math.Ldexp(r.next(), -int(uint64(r)>>40%12))) * 448
		check(half.FromBF16(half.BF16(v)), s)
	}
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	for _, c := range [][2]float32{{0, 1}, {float32(math.Copysign(0, -1)), 1}, {nan, 1}, {inf, inf}, {3, inf}, {-3, inf}, {1e-30, 1e-10 / 448}, {448, 1}, {460, 1}} {
		check(c[0], c[1])
	}
	g := quantMidpointGroup()
	s := half.FromBF16(g[0]) / 448
	wrong := 0
	for _, h := range g[1:] {
		v := half.FromBF16(h)
		check(v, s)
		if quantCode(v*(1/s)) != quantCode(v/s) {
			wrong++
		}
	}
	if wrong == 0 {
		t.Errorf("the midpoint group: v * (1/s) gives every code the division gives; it does not test the guard")
	}
	t.Logf("midpoint group: %d of %d codes wrong without the guard", wrong, len(g)-1)
}

// exactFMA32 is x*y + z rounded once to float32 (to nearest even), through
// exact big.Float arithmetic: the restatement FMA32 is checked against.
func exactFMA32(x, y, z float32) float32 {
	if math.IsNaN(float64(x)) || math.IsNaN(float64(y)) || math.IsNaN(float64(z)) ||
		math.IsInf(float64(x), 0) || math.IsInf(float64(y), 0) || math.IsInf(float64(z), 0) {
		return float32(float64(x)*float64(y) + float64(z))
	}
	p := new(big.Float).SetPrec(200).Mul(big.NewFloat(float64(x)).SetPrec(200), big.NewFloat(float64(y)).SetPrec(200))
	s := new(big.Float).SetPrec(400).Add(p, big.NewFloat(float64(z)).SetPrec(200))
	f, _ := s.Float32()
	return f
}

// TestFMA32 checks FMA32 (the w8a8 twin's __fmaf_rn) against exact
// arithmetic: on random triples, cancellations, and sums whose float64
// value lands exactly halfway between two float32 values while the exact sum
// does not (where rounding the float64 sum again would be wrong, in both
// directions and at several exponents).
func TestFMA32(t *testing.T) {
	type tc struct{ x, y, z float32 }
	var cases []tc
	// Double-rounding traps: z, and p = ±(ulp(z)/2)(1 + a 2^-23)(1 - a 2^-23),
	// so that the exact sum is a midpoint of z's neighbours -+ a² ulp 2^-47.
	for _, z0 := range []float32{1, 1 + 0x1p-23, 3 + 0x1p-22, 0x1p-100 * (1 + 0x1p-23), 0x1p100 * (1 + 3*0x1p-23), -1 - 0x1p-23} {
		ulp := math.Nextafter32(z0, float32(math.Inf(1))) - z0
		if z0 < 0 {
			ulp = z0 - math.Nextafter32(z0, float32(math.Inf(-1)))
		}
		for a := float32(1); a <= 4; a++ {
			x, y := (1+a*0x1p-23)*ulp/2, 1-a*0x1p-23
			cases = append(cases, tc{x, y, z0}, tc{-x, y, z0})
		}
	}
	naiveWrong := 0
	for _, c := range cases {
		if float32(float64(c.x)*float64(c.y)+float64(c.z)) != exactFMA32(c.x, c.y, c.z) {
			naiveWrong++
		}
	}
	if naiveWrong == 0 {
		t.Fatal("no double-rounding case among the constructed ones: the test checks nothing there")
	}
	r := lcg(11)
	f := func() float32 {
		r.next()
		v := math.Float32frombits(uint32(uint64(r) >> 32))
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return 1.5
		}
		return v
	}
	for range 20000 {
		x, y := f(), f()
		z := f()
		cases = append(cases, tc{x, y, z})
		p := float32(float64(x) * float64(y))
		cases = append(cases, tc{x, y, -p}, tc{x, y, -math.Nextafter32(p, 0)}) // cancellation
	}
	cases = append(cases, tc{0, 5, -0}, tc{float32(math.Inf(1)), 2, 1}, tc{3e38, 3e38, -1}, tc{1e-30, 1e-30, 1e-45})
	bad := 0
	for _, c := range cases {
		got, want := FMA32(c.x, c.y, c.z), exactFMA32(c.x, c.y, c.z)
		if math.Float32bits(got) != math.Float32bits(want) && !(got != got && want != want) {
			if bad++; bad <= 5 {
				t.Errorf("FMA32(%g, %g, %g) = %g (%#x), want %g (%#x)", c.x, c.y, c.z, got, math.Float32bits(got), want, math.Float32bits(want))
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d cases wrong (%d constructed double-rounding traps)", bad, len(cases), naiveWrong)
	}
}
