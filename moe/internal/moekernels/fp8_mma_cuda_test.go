package moekernels

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// The CUDA tests and benchmark of the FP8 expert GEMMs (moe_fp8_mma.cu):
// they skip where the CUDA backend does not open (or the GPU has no bf16
// mma.sync, compute capability below 8.0) and say which device ran.

// cudaTestDevice opens the CUDA backend's device 0 (closed when the test
// ends), or skips.
func cudaTestDevice(t testing.TB) *device {
	t.Helper()
	rt, err := gpuctx.OpenBackend("cuda")
	if err != nil {
		msg := err.Error()
		if i := strings.IndexByte(msg, '\n'); i >= 0 {
			msg = msg[:i]
		}
		t.Skipf("backend cuda not available, not tested: %s", msg)
	}
	t.Cleanup(func() { _ = rt.Close() })
	dev, err := rt.Device(0)
	if err != nil {
		t.Fatalf("cuda: Device(0): %v", err)
	}
	info := dev.Info()
	if info.ComputeMajor < 8 {
		t.Skipf("cuda device %s is compute capability %d.%d; the FP8 tiles need 8.0 (bf16 mma.sync)", info.Name, info.ComputeMajor, info.ComputeMinor)
	}
	t.Logf("testing on backend cuda (%s, compute capability %d.%d, %d SMs)", info.Name, info.ComputeMajor, info.ComputeMinor, info.SMCount)
	return &device{dev: dev, bufs: map[Ptr]*gpuctx.Buffer{}}
}

// fp8Shape is a layer's routed experts: E experts of hidden H and
// intermediate I, K experts per token.
type fp8Shape struct {
	name       string
	E, H, I, K int
}

// fp8Shapes are the expert shapes of the CUDA tests.
var fp8Shapes = []fp8Shape{
	{"deepseek-v2-lite", 64, 2048, 1408, 6},
	{"qwen3-30b-a3b", 128, 2048, 768, 8},
	{"partial", 16, 2000, 720, 4}, // 15.6 blocks of H, 5.6 of I
}

// fp8TwinRefs runs the twins of the case on the CPU backend and returns the
// results per assignment: up [TK][I] (act of each assignment's row) and down
// [TK][H].
func fp8TwinRefs(t *testing.T, c *fp8MMACase, cpu *device, wp fp8WeightPtrs) (up, down []uint16) {
	tile := FP8Gemms[0]
	return fp8PerAssignment(c, tile.BM, c.run(t, cpu, wp, tile, true)), c.run(t, cpu, wp, tile, false)
}

// fp8PerAssignment returns the act rows of the sort for BM in assignment
// order ([TK][I]).
func fp8PerAssignment(c *fp8MMACase, BM int, act []uint16) []uint16 {
	sorted, _, _, _ := c.align(BM)
	out := make([]uint16, len(c.idx)*c.I)
	for p, a := range sorted {
		if int(a) < len(c.idx) {
			copy(out[int(a)*c.I:][:c.I], act[p*c.I:][:c.I])
		}
	}
	return out
}

// fp8Compare compares the GPU's output of a tile with the twin's: per row p
// of the sort (up: act rows, padding rows zero) or per assignment (down). It
// returns the elements compared, those that differ, and max|d|/max|twin|.
func fp8Compare(c *fp8MMACase, BM int, up bool, got, twin []uint16) (n, diff int, rel float64, first string) {
	var g, w []float64
	add := func(i int, gv, wv uint16) {
		n++
		if gv != wv {
			if diff == 0 {
				first = fmt.Sprintf("element %d: %#04x, twin %#04x", i, gv, wv)
			}
			diff++
		}
		g, w = append(g, float64(bf16ToF32(gv))), append(w, float64(bf16ToF32(wv)))
	}
	if !up {
		for i := range twin {
			add(i, got[i], twin[i])
		}
		return n, diff, relErr(g, w), first
	}
	sorted, _, _, _ := c.align(BM)
	for p, a := range sorted {
		for i := range c.I {
			wv := uint16(0)
			if int(a) < len(c.idx) {
				wv = twin[int(a)*c.I+i]
			}
			add(p*c.I+i, got[p*c.I+i], wv)
		}
	}
	return n, diff, relErr(g, w), first
}

// fp8Float64 checks the down twin against a float64 GEMM on the dequantized
// weights within 1e-2 (the up twin's check is TestFP8MMATwin's).
func fp8Float64(t *testing.T, c *fp8MMACase, down []uint16) {
	var ref []float64
	for a := range len(c.idx) {
		ar := bf16Row(c.actA[a*c.I:][:c.I])
		for h := range c.H {
			ref = append(ref, fp8Dot64(ar, c.down[c.idx[a]], h))
		}
	}
	if e := relErr(bf16s64(down), ref); e > 1e-2 {
		t.Errorf("down: max|d|/max|ref| = %.3g against float64, want <= 1e-2", e)
	}
}

// TestFP8MMACUDA runs every FP8 tile's up and down kernels on the GPU at 1,
// 8, 64 and 256 tokens of DeepSeek-V2-Lite's, Qwen3-30B-A3B's and a
// partial-block shape, and compares them with their Go twins: bit for bit on
// exactly summable data, plain and widened to per-block magnitudes from
// 2^-30 to 2^30 (where the tensor core's block sums cannot differ
// from the twin's, so every other step, scale, order, conversion, epilogue,
// is checked to the bit), and within 1e-2 (max|d|/max|twin|) on general
// data, where the tensor core adds each block's products in its own order
// (the test logs how many elements differ); and every tile bit for bit with
// the others on all data.
func TestFP8MMACUDA(t *testing.T) {
	fp8CheckDevice(t, cudaTestDevice(t), fp8Shapes, []int{1, 8, 64, 256})
}

// TestFP8MMAHarness runs TestFP8MMACUDA's comparison with a second CPU
// device in the GPU's place at small sizes (the twins against themselves),
// so that its bookkeeping (the per-assignment references, row mapping,
// padding rows) is tested without a GPU.
func TestFP8MMAHarness(t *testing.T) {
	small := []fp8Shape{{"small partial", 5, 272, 144, 2}}
	fp8CheckDevice(t, newTestDevice(t), small, []int{1, 8, 33})
}

// fp8CheckDevice compares every FP8 tile on dev with the twins, for each
// shape and token count, on exact, wide (exact, with per-block magnitudes
// from 2^-30 to 2^30: fp8MMACase.widen) and general data.
func fp8CheckDevice(t *testing.T, dev *device, shapes []fp8Shape, tokens []int) {
	for si, sh := range shapes {
		for _, data := range []string{"exact", "wide", "general"} {
			exact := data != "general"
			w := newFP8MMAWeights(sh.E, sh.H, sh.I, exact, uint64(100+si))
			cpu := newTestDevice(t)
			gw, cw := w.upload(t, dev), w.upload(t, cpu)
			for _, T := range tokens {
				c := w.batch(T, sh.K, uint64(1000*si+T))
				if data == "wide" {
					c.widen(uint64(7 + T))
				}
				upRef, downRef := fp8TwinRefs(t, c, cpu, cw)
				if T <= 8 && !exact {
					fp8Float64(t, c, downRef)
				}
				fp8CheckTiles(t, dev, c, gw, [2][]uint16{downRef, upRef}, fmt.Sprintf("%s/%s/T=%d", sh.name, data, T))
			}
		}
	}
}

// fp8CheckTiles runs every FP8 tile's up and down kernels of the case on dev
// and compares them with the twin's results (refs: down, up per
// assignment): bit for bit on exact data, within 1e-2 otherwise; and with
// each other, bit for bit on any data (every tile sums each output in the
// same mma sequence).
func fp8CheckTiles(t *testing.T, dev *device, c *fp8MMACase, gw fp8WeightPtrs, refs [2][]uint16, prefix string) {
	var first [2][]uint16
	var firstTag string
	for _, tile := range FP8Gemms {
		for ui, up := range []bool{false, true} {
			name := fmt.Sprintf("%s/%s/up=%v", prefix, tile.Tag(), up)
			got := c.run(t, dev, gw, tile, up)
			n, diff, rel, where := fp8Compare(c, tile.BM, up, got, refs[ui])
			switch {
			case c.exact && diff > 0:
				t.Errorf("%s: %d of %d elements differ from the twin (relative %.3g); first %s", name, diff, n, rel, where)
			case rel > 1e-2:
				t.Errorf("%s: max|d|/max|twin| = %.3g, want <= 1e-2 (%d of %d elements differ)", name, rel, diff, n)
			case !c.exact:
				t.Logf("%s: %d of %d elements differ from the twin, relative %.3g", name, diff, n, rel)
			}
			if up {
				got = fp8PerAssignment(c, tile.BM, got)
			}
			if first[ui] == nil {
				first[ui], firstTag = got, tile.Tag()
			} else if d := countDiff(got, first[ui]); d > 0 {
				t.Errorf("%s: %d elements differ bitwise from tile %s's", name, d, firstTag)
			}
		}
	}
}

func countDiff(a, b []uint16) int {
	n := 0
	for i := range a {
		if a[i] != b[i] {
			n++
		}
	}
	return n
}

// fp8BenchWeights are nsets copies of a layer's expert weights on the GPU,
// FP8 and bf16, filled from a random pattern (the values do not change the
// timing).
type fp8BenchWeights struct {
	gu, gus, down, downs []Ptr // FP8 codes and scales, per set
	bgu, bdown           []Ptr // bf16, per set
}

// fp8Fill allocates n bytes on d filled with copies of pat (on the device).
func fp8Fill(b testing.TB, d *device, pat *gpuctx.Buffer, n int) Ptr {
	p, err := d.Alloc(n)
	if err != nil {
		b.Fatalf("Alloc(%d): %v", n, err)
	}
	buf := d.bufs[p]
	for off := 0; off < n; off += pat.Size() {
		m := min(pat.Size(), n-off)
		dst, err := buf.Slice(off, m)
		if err == nil {
			var src *gpuctx.Buffer
			if src, err = pat.Slice(0, m); err == nil {
				err = dst.CopyFrom(src)
			}
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	return p
}

// fp8Pattern uploads 16 MiB of random values of the given kind: finite E4M3
// codes, bf16 in [-0.1, 0.1), or f32 scales in [2^-12, 2^-11).
func fp8Pattern(b testing.TB, d *device, kind string) *gpuctx.Buffer {
	r := lcg(uint64(len(kind)))
	raw := make([]byte, 16<<20)
	for i := 0; i < len(raw); i += 4 {
		v := r.next()
		var w uint32
		switch kind {
		case "e4m3":
			for j := range 4 {
				w |= uint32(fp8AllCodes[int(uint64(r)>>33)%len(fp8AllCodes)]) << (8 * j)
				r.next()
			}
		case "bf16":
			w = uint32(f32ToBF16(float32(v/10))) | uint32(f32ToBF16(float32(-v/10)))<<16
		default:
			w = math.Float32bits(float32(math.Ldexp(1.5+v/2, -12)))
		}
		raw[i], raw[i+1], raw[i+2], raw[i+3] = byte(w), byte(w>>8), byte(w>>16), byte(w>>24)
	}
	return d.bufs[upload(b, d, raw)]
}

func newFP8BenchWeights(b testing.TB, d *device, E, H, I, nsets int) *fp8BenchWeights {
	codes, bf, scales := fp8Pattern(b, d, "e4m3"), fp8Pattern(b, d, "bf16"), fp8Pattern(b, d, "f32")
	kb := func(n int) int { return (n + 127) / 128 }
	w := &fp8BenchWeights{}
	for range nsets {
		w.gu = append(w.gu, fp8Fill(b, d, codes, E*2*I*H))
		w.gus = append(w.gus, fp8Fill(b, d, scales, 4*E*2*kb(I)*kb(H)))
		w.down = append(w.down, fp8Fill(b, d, codes, E*H*I))
		w.downs = append(w.downs, fp8Fill(b, d, scales, 4*E*kb(H)*kb(I)))
		w.bgu = append(w.bgu, fp8Fill(b, d, bf, 2*E*2*I*H))
		w.bdown = append(w.bdown, fp8Fill(b, d, bf, 2*E*H*I))
	}
	return w
}

// fp8BenchBatch is one batch of the benchmark on the GPU: T tokens routed
// uniformly at random to K distinct experts, the aligned sort for every BM,
// and the activation buffers.
type fp8BenchBatch struct {
	T, TK, touched int
	x, act, out    Ptr
	plans          map[int]fp8Plan // by BM
}

// fp8Plan is an aligned sort on the GPU and its row count.
type fp8Plan struct {
	sorted, blockExpert, npost Ptr
	cap                        int
}

func newFP8BenchBatch(b testing.TB, d *device, E, H, I, K, T int) *fp8BenchBatch {
	r := lcg(uint64(T*E + K))
	c := &fp8MMACase{fp8MMAWeights: &fp8MMAWeights{E: E, H: H, I: I}, T: T, K: K,
		sorted: map[int][]int32{}, blockExp: map[int][]int32{}, npost: map[int]int32{}}
	used := map[int32]bool{}
	for range T {
		row := map[int32]bool{}
		for len(row) < K {
			e := int32(uint64(r) >> 33 % uint64(E))
			r.next()
			if !row[e] {
				row[e], used[e] = true, true
				c.idx = append(c.idx, e)
			}
		}
	}
	bb := &fp8BenchBatch{T: T, TK: T * K, touched: len(used), plans: map[int]fp8Plan{}}
	maxCap := 0
	for _, bm := range []int{8, 16, 32, 64, 128, 192} {
		sorted, blockExpert, npost, cp := c.align(bm)
		bb.plans[bm] = fp8Plan{upload(b, d, asBytes(sorted)), upload(b, d, asBytes(blockExpert)),
			upload(b, d, asBytes([]int32{npost})), cp}
		maxCap = max(maxCap, cp)
	}
	// Random activations, not zeros: zeros would make every gate sum 0, which
	// sends each SwiGLU division of the up epilogues down the divider's slow
	// path, and leave the w8a8 quantizer and tensor cores nothing to do
	// (sessions 10-14 timed these kernels on zero activations).
	bb.x = fp8Fill(b, d, fp8Pattern(b, d, "bf16"), 2*T*H)
	bb.act = upload(b, d, make([]byte, 2*maxCap*I))
	bb.out = upload(b, d, make([]byte, 2*bb.TK*H))
	return bb
}

// fp8Kernel is one timed kernel: a launch for weight set i.
type fp8Kernel struct {
	bm     int
	up     bool
	tag    string
	launch func(s *gpuctx.Stream, set int) error
}

// fp8Timer times launches with CUDA events on one stream.
type fp8Timer struct {
	s      *gpuctx.Stream
	ev     [2]*gpuctx.Event
	nsets  int
	warmup int
	iters  int
}

// perCall returns the device time of one call of each fn (in turn, each
// the mean over iters back-to-back calls between two events, the weight set
// rotating from call to call) in microseconds.
func (tm *fp8Timer) perCall(b testing.TB, fns ...func(s *gpuctx.Stream, set int) error) []float64 {
	for i := range tm.warmup {
		for _, fn := range fns {
			if err := fn(tm.s, i%tm.nsets); err != nil {
				b.Fatal(err)
			}
		}
	}
	out := make([]float64, len(fns))
	for j, fn := range fns {
		if err := tm.ev[0].Record(tm.s); err != nil {
			b.Fatal(err)
		}
		for i := range tm.iters {
			if err := fn(tm.s, i%tm.nsets); err != nil {
				b.Fatal(err)
			}
		}
		if err := tm.ev[1].Record(tm.s); err != nil {
			b.Fatal(err)
		}
		if err := tm.ev[1].Synchronize(); err != nil {
			b.Fatal(err)
		}
		el, err := tm.ev[1].Elapsed(tm.ev[0])
		if err != nil {
			b.Fatal(err)
		}
		out[j] = float64(el.Nanoseconds()) / 1e3 / float64(tm.iters)
	}
	return out
}

// fp8Best times every kernel and returns the fastest up and down pair of
// one BM (an up kernel of that BM and a down kernel of that BM), with the
// pair's time.
func (tm *fp8Timer) fp8Best(b testing.TB, ks []fp8Kernel) (up, down fp8Kernel, us float64) {
	bestUp, bestDown := map[int]int{}, map[int]int{}
	times := make([]float64, len(ks))
	for i, k := range ks {
		times[i] = tm.perCall(b, k.launch)[0]
		best := bestDown
		if k.up {
			best = bestUp
		}
		if j, ok := best[k.bm]; !ok || times[i] < times[j] {
			best[k.bm] = i
		}
	}
	var log []string
	for i, k := range ks {
		log = append(log, fmt.Sprintf("%s %s %.1f", map[bool]string{true: "up", false: "down"}[k.up], k.tag, times[i]))
	}
	b.Logf("each kernel alone, us: %s", strings.Join(log, ", "))
	us = math.Inf(1)
	for bm, i := range bestUp {
		if j, ok := bestDown[bm]; ok && times[i]+times[j] < us {
			up, down, us = ks[i], ks[j], times[i]+times[j]
		}
	}
	return up, down, us
}

func launcher(d *device, name string, grid [2]int, threads, smem int, args func(set int) []any) (func(*gpuctx.Stream, int) error, error) {
	k, err := d.dev.Kernel(name)
	if err != nil {
		return nil, err
	}
	g, bl := gpuctx.Dim3{X: grid[0], Y: max(grid[1], 1), Z: 1}, gpuctx.Dim3{X: threads, Y: 1, Z: 1}
	return func(s *gpuctx.Stream, set int) error { return s.Launch(k, g, bl, smem, args(set)...) }, nil
}

// fp8Kernels returns the FP8 tiles' up and down launches of a batch.
func fp8Kernels(d *device, w *fp8BenchWeights, bb *fp8BenchBatch, H, I, K int) []fp8Kernel {
	var ks []fp8Kernel
	for _, c := range FP8Gemms {
		pl := bb.plans[c.BM]
		gx, gy := c.Grid(I, pl.cap)
		up, err := launcher(d, c.UpName(), [2]int{gx, gy}, c.Threads(), c.SmemBytes(true), func(set int) []any {
			return []any{bb.x, w.gu[set], w.gus[set], pl.sorted, pl.blockExpert, pl.npost, bb.act,
				int32(bb.TK), int32(K), int32(H), int32(I), int32(0), int32(0)}
		})
		if err == nil {
			ks = append(ks, fp8Kernel{c.BM, true, c.Tag(), up})
		}
		gx, gy = c.Grid(H, pl.cap)
		down, err := launcher(d, c.DownName(), [2]int{gx, gy}, c.Threads(), c.SmemBytes(false), func(set int) []any {
			return []any{bb.act, w.down[set], w.downs[set], pl.sorted, pl.blockExpert, pl.npost, bb.out,
				int32(bb.TK), int32(H), int32(I)}
		})
		if err == nil {
			ks = append(ks, fp8Kernel{c.BM, false, c.Tag(), down})
		}
	}
	return ks
}

// bf16Kernels returns moe_gemm.cu's and moe_wgmma.cu's bf16 tiles' up and
// down launches of a batch (the kernels this device has).
func bf16Kernels(d *device, w *fp8BenchWeights, bb *fp8BenchBatch, H, I, K int) []fp8Kernel {
	var ks []fp8Kernel
	sms := d.dev.Info().SMCount
	for _, c := range MoEGemms {
		pl, ok := bb.plans[c.BM]
		if !ok {
			continue
		}
		if c.HasUp() {
			gx, gy := c.Grid(I, pl.cap, sms)
			up, err := launcher(d, c.UpName(), [2]int{gx, gy}, c.Threads(), c.SmemBytes(true), func(set int) []any {
				return []any{bb.x, w.bgu[set], pl.sorted, pl.blockExpert, pl.npost, bb.act,
					int32(bb.TK), int32(K), int32(H), int32(I), int32(0), int32(0)}
			})
			if err == nil {
				ks = append(ks, fp8Kernel{c.BM, true, c.Tag(), up})
			}
		}
		gx, gy := c.Grid(H, pl.cap, sms)
		down, err := launcher(d, c.DownName(), [2]int{gx, gy}, c.Threads(), c.SmemBytes(false), func(set int) []any {
			return []any{bb.act, w.bdown[set], pl.sorted, pl.blockExpert, pl.npost, bb.out,
				int32(bb.TK), int32(H), int32(I)}
		})
		if err == nil {
			ks = append(ks, fp8Kernel{c.BM, false, c.Tag(), down})
		}
	}
	return ks
}

// TestFP8BenchHarness runs BenchmarkFP8Expert's machinery on the CPU
// backend at a small size (the twins check every launch's arguments): the
// batch, both tile sweeps and the pairs they choose.
func TestFP8BenchHarness(t *testing.T) {
	d := newTestDevice(t)
	w := newFP8BenchWeights(t, d, 4, 256, 128, 2)
	bb := newFP8BenchBatch(t, d, 4, 256, 128, 2, 5)
	tm := newFP8Timer(t, d, 2, 1, 1)
	if n := len(fp8Kernels(d, w, bb, 256, 128, 2)); n != 2*len(FP8Gemms) {
		t.Errorf("%d FP8 kernels, want %d", n, 2*len(FP8Gemms))
	}
	fu, fd, bu, bd := fp8BenchPairs(t, d, tm, w, bb, 256, 128, 2)
	if !fu.up || fd.up || fu.bm != fd.bm || !bu.up || bd.up || bu.bm != bd.bm {
		t.Errorf("pairs FP8 %+v / %+v, bf16 %+v / %+v: want an up and a down kernel of one BM each", fu, fd, bu, bd)
	}
	if bb.touched < 2 || bb.touched > 4 {
		t.Errorf("%d experts touched by 5 tokens of 2 of 4 experts", bb.touched)
	}
}

// fp8BenchShapes are the benchmark's layers: fp8Shapes' two models and
// DeepSeek-V3's experts.
var fp8BenchShapes = []fp8Shape{
	{"deepseek-v2-lite", 64, 2048, 1408, 6},
	{"qwen3-30b-a3b", 128, 2048, 768, 8},
	{"deepseek-v3", 256, 7168, 2048, 8},
}

// BenchmarkFP8Expert times the routed experts' up and down GEMMs of a layer
// at 1, 8, 64 and 256 tokens (random routing): the fastest FP8 tile pair
// (moe_fp8_mma.cu) against the fastest bf16 tile pair (moe_gemm.cu,
// moe_wgmma.cu) of the same rows, each pair's BM chosen by a sweep, then
// both timed with CUDA events in turn, rotating up to four copies of the
// weights so that the 50 MB L2 does not serve them. It reports microseconds
// per up+down call, the ratio bf16/fp8 and the achieved bandwidth of the
// touched experts' weight bytes (FP8: codes and scales) against the H200's
// copy ceiling of about 4100 GB/s.
func BenchmarkFP8Expert(b *testing.B) {
	d := cudaTestDevice(b)
	for _, sh := range fp8BenchShapes {
		perSet := sh.E * 3 * sh.I * sh.H * 3 // FP8 and bf16 bytes of one set
		nsets := min(max((24<<30)/perSet, 1), 4)
		if free, _, err := d.dev.MemInfo(); err != nil || free < uint64(nsets*perSet+(2<<30)) {
			b.Logf("%s: %d GiB free, not enough for %d weight sets of %d MiB: skipped (%v)", sh.name, free>>30, nsets, perSet>>20, err)
			continue
		}
		w := newFP8BenchWeights(b, d, sh.E, sh.H, sh.I, nsets)
		for _, T := range []int{1, 8, 64, 256} {
			b.Run(fmt.Sprintf("%s/T=%d", sh.name, T), func(b *testing.B) {
				fp8BenchBatchRun(b, d, w, nsets, sh.E, sh.H, sh.I, sh.K, T)
			})
		}
		for _, ps := range [][]Ptr{w.gu, w.gus, w.down, w.downs, w.bgu, w.bdown} {
			for _, p := range ps {
				_ = d.bufs[p].Free()
				delete(d.bufs, p)
			}
		}
	}
}

// newFP8Timer returns a timer on a new stream of d (closed with its events
// when the test ends).
func newFP8Timer(tb testing.TB, d *device, nsets, warmup, iters int) *fp8Timer {
	s, err := d.dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = s.Close() })
	tm := &fp8Timer{s: s, nsets: nsets, warmup: warmup, iters: iters}
	for i := range tm.ev {
		if tm.ev[i], err = d.dev.NewEvent(true); err != nil {
			tb.Fatal(err)
		}
		ev := tm.ev[i]
		tb.Cleanup(func() { _ = ev.Close() })
	}
	return tm
}

// fp8BenchPairs sweeps the FP8 and the bf16 tiles on a batch and returns
// the fastest pair of each.
func fp8BenchPairs(tb testing.TB, d *device, tm *fp8Timer, w *fp8BenchWeights, bb *fp8BenchBatch, H, I, K int) (fu, fd, bu, bd fp8Kernel) {
	fu, fd, fus := tm.fp8Best(tb, fp8Kernels(d, w, bb, H, I, K))
	bu, bd, bus := tm.fp8Best(tb, bf16Kernels(d, w, bb, H, I, K))
	if fu.launch == nil || bu.launch == nil {
		tb.Fatalf("no FP8 (%v) or no bf16 (%v) tile pair runs on this device", fu.launch != nil, bu.launch != nil)
	}
	tb.Logf("T=%d sweep: FP8 up %s + down %s %.1f us, bf16 up %s + down %s %.1f us (each kernel timed alone)",
		bb.T, fu.tag, fd.tag, fus, bu.tag, bd.tag, bus)
	return fu, fd, bu, bd
}

func fp8BenchBatchRun(b *testing.B, d *device, w *fp8BenchWeights, nsets, E, H, I, K, T int) {
	bb := newFP8BenchBatch(b, d, E, H, I, K, T)
	tm := newFP8Timer(b, d, nsets, 3, 10)
	fu, fd, bu, bd := fp8BenchPairs(b, d, tm, w, bb, H, I, K)
	b.Logf("T=%d: %d of %d experts touched", T, bb.touched, E)
	tm.warmup, tm.iters = 0, 20
	pair := func(up, down fp8Kernel) func(*gpuctx.Stream, int) error {
		return func(s *gpuctx.Stream, set int) error {
			if err := up.launch(s, set); err != nil {
				return err
			}
			return down.launch(s, set)
		}
	}
	var fp8us, bf16us float64
	n := 0
	for b.Loop() {
		t := tm.perCall(b, pair(fu, fd), pair(bu, bd))
		fp8us, bf16us = fp8us+t[0], bf16us+t[1]
		n++
	}
	fp8us, bf16us = fp8us/float64(n), bf16us/float64(n)
	kb := func(x int) int { return (x + 127) / 128 }
	fp8Bytes := float64(bb.touched) * float64(3*I*H+4*(2*kb(I)*kb(H)+kb(H)*kb(I)))
	bf16Bytes := float64(bb.touched) * float64(3*I*H*2)
	b.ReportMetric(fp8us, "fp8-us/call")
	b.ReportMetric(bf16us, "bf16-us/call")
	b.ReportMetric(bf16us/fp8us, "bf16/fp8")
	b.ReportMetric(fp8Bytes/fp8us/1e3, "fp8-GB/s")
	b.ReportMetric(bf16Bytes/bf16us/1e3, "bf16-GB/s")
	b.ReportMetric(100*fp8Bytes/fp8us/1e3/4100, "fp8-%copy")
}
