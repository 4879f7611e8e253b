package conformance

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
)

func newBlasContext(t *testing.T, dev *gpuctx.Device, s *gpuctx.Stream) *gpuctx.Context {
	t.Helper()
	ctx, err := dev.NewContext(gpuctx.ContextOptions{Stream: s})
	if err != nil {
		t.Fatalf("Device.NewContext: %v", err)
	}
	t.Cleanup(func() { _ = ctx.Close() })
	return ctx
}

// unsupported reports whether err says the backend cannot run this type
// combination (ErrUnavailable): the case is logged and skipped, not failed.
func unsupported(t *testing.T, what string, err error) bool {
	t.Helper()
	if errors.Is(err, gpuctx.ErrUnavailable) {
		t.Logf("%s: not supported by this backend: %v", what, err)
		return true
	}
	return false
}

// gemmCase is one GEMM (or a batch of count, with strides between matrices)
// on buffers sized exactly for it, with padded leading dimensions.
type gemmCase struct {
	tp             gemmType
	layout         gpuctx.Layout
	ta, tb         bool
	m, n, k, count int
	gap            [3]int // extra elements between matrices of a batch (A, B, C)
}

func (c gemmCase) String() string {
	return fmt.Sprintf("%v %v ta=%v tb=%v %dx%dx%d", c.tp, c.layout, c.ta, c.tb, c.m, c.n, c.k)
}

// run uploads random small-integer operands, runs call (which queues the
// GEMM through h with the Gemm and strides it is given), and checks C exactly
// (up to the sign of a zero) against the float64 reference (the gaps between C's matrices included:
// they must be untouched) and that A and B are unchanged.
func (c gemmCase) run(t *testing.T, dev *gpuctx.Device, ctx *gpuctx.Context, r *rand.Rand,
	call func(h gpuctx.Blas, g gpuctx.Gemm, sa, sb, sc int) error) {
	t.Helper()
	am, bm, cm := gemmMats(c.layout, c.ta, c.tb, c.m, c.n, c.k, [3]int{1, 2, 3})
	sa, sb, sc := am.span()+c.gap[0], bm.span()+c.gap[1], cm.span()+c.gap[2]
	count := max(c.count, 1)
	a := decode(c.tp.ab, encode(c.tp.ab, intsF64(r, (count-1)*sa+am.span(), -3, 3)))
	b := decode(c.tp.ab, encode(c.tp.ab, intsF64(r, (count-1)*sb+bm.span(), -3, 3)))
	cv := decode(c.tp.c, encode(c.tp.c, intsF64(r, (count-1)*sc+cm.span(), -3, 3)))
	aBytes, bBytes := encode(c.tp.ab, a), encode(c.tp.ab, b)
	A, B, C := upload(t, dev, aBytes), upload(t, dev, bBytes), upload(t, dev, encode(c.tp.c, cv))
	const alpha, beta = 0.5, 0.25 // powers of two: every result is exact in every type
	want := append([]float64(nil), cv...)
	for i := range count {
		refGemm(c.ta, c.tb, c.m, c.n, c.k, alpha, am, a[i*sa:], bm, b[i*sb:], beta, cm, want[i*sc:])
	}
	g := gpuctx.Gemm{Layout: c.layout, TransA: c.ta, TransB: c.tb, M: c.m, N: c.n, K: c.k, Alpha: alpha, Beta: beta,
		A: A, B: B, C: C, LDA: am.ld, LDB: bm.ld, LDC: cm.ld, AB: c.tp.ab, CType: c.tp.c}
	what := fmt.Sprintf("%v x%d strides %d %d %d", c, count, sa, sb, sc)
	if err := ctx.Blas(func(h gpuctx.Blas) error { return call(h, g, sa, sb, sc) }); err != nil {
		if unsupported(t, what, err) {
			return
		}
		t.Fatalf("%s: %v", what, err)
	}
	sameVals(t, what+": C", c.tp.c, download(t, dev, C), want)
	sameBytes(t, what+": A unchanged", download(t, dev, A), aBytes)
	sameBytes(t, what+": B unchanged", download(t, dev, B), bBytes)
}

// forEachGemm calls f for every type pair, layout and transpose combination.
func forEachGemm(f func(tp gemmType, layout gpuctx.Layout, ta, tb bool)) {
	for _, tp := range gemmTypes {
		for _, layout := range []gpuctx.Layout{gpuctx.RowMajor, gpuctx.ColMajor} {
			for _, ta := range []bool{false, true} {
				for _, tb := range []bool{false, true} {
					f(tp, layout, ta, tb)
				}
			}
		}
	}
}

// TestBlasGemm runs Blas.Gemm for every supported type pair (f32, f64, f16 and
// bf16 inputs; C of the input type or f32), in both layouts, with every
// transpose, non-square shapes and padded leading dimensions. Inputs are small
// integers and alpha, beta powers of two, so C must equal the float64
// reference exactly (up to the sign of a zero); A and B must be unchanged.
func TestBlasGemm(t *testing.T, dev *gpuctx.Device) {
	ctx := newBlasContext(t, dev, newStream(t, dev))
	r := newRand(t)
	forEachGemm(func(tp gemmType, layout gpuctx.Layout, ta, tb bool) {
		gemmCase{tp: tp, layout: layout, ta: ta, tb: tb, m: 5, n: 3, k: 4}.run(t, dev, ctx, r,
			func(h gpuctx.Blas, g gpuctx.Gemm, _, _, _ int) error { return h.Gemm(g) })
	})
}

// TestBlasStridedBatched runs strided batched GEMMs whose A, B and C strides
// all differ (with gaps between the matrices), for every type pair, in both
// layouts, with every transpose and padded leading dimensions, on buffers
// sized exactly for the batch. C (the gaps included) must equal the host
// reference exactly, and A and B must be unchanged.
func TestBlasStridedBatched(t *testing.T, dev *gpuctx.Device) {
	ctx := newBlasContext(t, dev, newStream(t, dev))
	r := newRand(t)
	forEachGemm(func(tp gemmType, layout gpuctx.Layout, ta, tb bool) {
		gemmCase{tp: tp, layout: layout, ta: ta, tb: tb, m: 5, n: 3, k: 4, count: 3, gap: [3]int{3, 8, 1}}.run(t, dev, ctx, r,
			func(h gpuctx.Blas, g gpuctx.Gemm, sa, sb, sc int) error {
				return h.GemmStridedBatched(g, 3, sa, sb, sc)
			})
	})
}

// TestBlasGrouped runs GemmGrouped with groups of different shapes, among them
// empty ones (M == 0, N == 0, which must touch nothing) and one with K == 0
// (C = Beta*C), for every type pair and both layouts. Every group's C must
// equal the reference exactly, the empty groups' C must be unchanged, and
// no input may change. An empty list and a list of only empty groups succeed.
func TestBlasGrouped(t *testing.T, dev *gpuctx.Device) {
	ctx := newBlasContext(t, dev, newStream(t, dev))
	r := newRand(t)
	shapes := []struct{ m, n, k int }{{4, 3, 5}, {0, 3, 5}, {6, 2, 3}, {3, 0, 2}, {2, 5, 0}, {1, 1, 7}}
	for _, tp := range gemmTypes {
		for _, layout := range []gpuctx.Layout{gpuctx.RowMajor, gpuctx.ColMajor} {
			const alpha, beta = 0.5, -0.25
			type group struct {
				am, bm, cm     mat
				a, b, c, want  []float64
				A, B, C        *gpuctx.Buffer
				aBytes, bBytes []byte
			}
			var groups []group
			var gs []gpuctx.Gemm
			for i, sh := range shapes {
				ta, tb := i%2 == 1, i%3 == 1
				am, bm, cm := gemmMats(layout, ta, tb, sh.m, sh.n, sh.k, [3]int{i % 2, 1, 0})
				// At least one element per operand: empty groups still need buffers.
				g := group{am: am, bm: bm, cm: cm}
				g.a = decode(tp.ab, encode(tp.ab, intsF64(r, max(am.span(), 1), -3, 3)))
				g.b = decode(tp.ab, encode(tp.ab, intsF64(r, max(bm.span(), 1), -3, 3)))
				g.c = decode(tp.c, encode(tp.c, intsF64(r, max(cm.span(), 1), -3, 3)))
				g.want = append([]float64(nil), g.c...)
				refGemm(ta, tb, sh.m, sh.n, sh.k, alpha, am, g.a, bm, g.b, beta, cm, g.want)
				g.aBytes, g.bBytes = encode(tp.ab, g.a), encode(tp.ab, g.b)
				g.A, g.B, g.C = upload(t, dev, g.aBytes), upload(t, dev, g.bBytes), upload(t, dev, encode(tp.c, g.c))
				groups = append(groups, g)
				gs = append(gs, gpuctx.Gemm{Layout: layout, TransA: ta, TransB: tb, M: sh.m, N: sh.n, K: sh.k,
					Alpha: alpha, Beta: beta, A: g.A, B: g.B, C: g.C, LDA: am.ld, LDB: bm.ld, LDC: cm.ld, AB: tp.ab, CType: tp.c})
			}
			what := fmt.Sprintf("%v %v", tp, layout)
			if err := ctx.Blas(func(h gpuctx.Blas) error { return h.GemmGrouped(gs) }); err != nil {
				if unsupported(t, what, err) {
					continue
				}
				t.Fatalf("%s: GemmGrouped: %v", what, err)
			}
			for i, g := range groups {
				gw := fmt.Sprintf("%s group %d (%dx%dx%d)", what, i, shapes[i].m, shapes[i].n, shapes[i].k)
				sameVals(t, gw+": C", tp.c, download(t, dev, g.C), g.want)
				sameBytes(t, gw+": A unchanged", download(t, dev, g.A), g.aBytes)
				sameBytes(t, gw+": B unchanged", download(t, dev, g.B), g.bBytes)
			}
		}
	}
	must(t, "GemmGrouped with no groups", ctx.Blas(func(h gpuctx.Blas) error { return h.GemmGrouped(nil) }))
	one := upload(t, dev, encode(gpuctx.F32, []float64{7}))
	empty := gpuctx.Gemm{M: 0, N: 1, K: 1, Alpha: 1, A: one, B: one, C: one, AB: gpuctx.F32, CType: gpuctx.F32}
	must(t, "GemmGrouped with only empty groups", ctx.Blas(func(h gpuctx.Blas) error {
		return h.GemmGrouped([]gpuctx.Gemm{empty, empty})
	}))
	sameBytes(t, "C of an all-empty grouped call", download(t, dev, one), encode(gpuctx.F32, []float64{7}))
}

// TestBlasGeam runs Geam (C = Alpha*op(A) + Beta*op(B), op the plain
// transpose, never the conjugate) for f32, f64, c64 and c128, in both layouts,
// with every transpose and padded leading dimensions. Real types use the real
// parts of Alpha and Beta. Results must equal the complex128 reference
// exactly; A and B must be unchanged.
func TestBlasGeam(t *testing.T, dev *gpuctx.Device) {
	ctx := newBlasContext(t, dev, newStream(t, dev))
	r := newRand(t)
	const m, n = 4, 3
	for _, dt := range []gpuctx.DType{gpuctx.F32, gpuctx.F64, gpuctx.C64, gpuctx.C128} {
		cplx := dt == gpuctx.C64 || dt == gpuctx.C128
		alpha, beta := complex(0.5, 0), complex(-2, 0)
		if cplx {
			alpha, beta = complex(0.5, 0.25), complex(-2, 1)
		}
		vals := func(n int) []complex128 {
			v := make([]complex128, n)
			for i := range v {
				v[i] = complex(float64(r.IntN(7)-3), 0)
				if cplx {
					v[i] += complex(0, float64(r.IntN(7)-3))
				}
			}
			return v
		}
		for _, layout := range []gpuctx.Layout{gpuctx.RowMajor, gpuctx.ColMajor} {
			for _, ta := range []bool{false, true} {
				for _, tb := range []bool{false, true} {
					stored := func(trans bool, pad int) mat {
						rows, cols := m, n
						if trans {
							rows, cols = n, m
						}
						return mat{layout, rows, cols, packedLD(layout, rows, cols) + pad}
					}
					am, bm, cm := stored(ta, 2), stored(tb, 1), stored(false, 3)
					a, b, c := vals(am.span()), vals(bm.span()), vals(cm.span())
					want := append([]complex128(nil), c...)
					refGeam(ta, tb, m, n, alpha, am, a, beta, bm, b, cm, want)
					aBytes, bBytes := encodeComplex(dt, a), encodeComplex(dt, b)
					A, B, C := upload(t, dev, aBytes), upload(t, dev, bBytes), upload(t, dev, encodeComplex(dt, c))
					what := fmt.Sprintf("%v %v ta=%v tb=%v", dt, layout, ta, tb)
					err := ctx.Blas(func(h gpuctx.Blas) error {
						return h.Geam(gpuctx.Geam{Layout: layout, TransA: ta, TransB: tb, M: m, N: n, Alpha: alpha, Beta: beta,
							A: A, B: B, C: C, LDA: am.ld, LDB: bm.ld, LDC: cm.ld, Type: dt})
					})
					if err != nil {
						if unsupported(t, what, err) {
							continue
						}
						t.Fatalf("%s: Geam: %v", what, err)
					}
					sameComplex(t, what+": C", dt, download(t, dev, C), want)
					sameBytes(t, what+": A unchanged", download(t, dev, A), aBytes)
					sameBytes(t, what+": B unchanged", download(t, dev, B), bBytes)
				}
			}
		}
	}
}

// TestBlasExtents checks that BLAS ops whose operands do not fit their buffers
// (one element short after the row-major mapping, a batch that runs past the
// end, a stride or leading dimension so large the extent overflows) fail with
// ErrInvalid naming the call, the user's operand and the bytes, before any work
// is queued: C is untouched and the stream stays usable.
func TestBlasExtents(t *testing.T, dev *gpuctx.Device) {
	s := newStream(t, dev)
	ctx := newBlasContext(t, dev, s)
	const m, n, k, count = 3, 4, 5, 3
	// Packed in either layout: A 15, B 20, C 12 elements per matrix.
	sa, sb, sc := 17, 23, 13
	fa, fb, fc := 2*sa+15, 2*sb+20, 2*sc+12
	cBytes := filled(4*fc, 0x7f)
	buf := func(elems int) *gpuctx.Buffer { return upload(t, dev, filled(4*elems, 0x3c)) }
	gemm := func(layout gpuctx.Layout, a, b, c *gpuctx.Buffer) gpuctx.Gemm {
		return gpuctx.Gemm{Layout: layout, M: m, N: n, K: k, Alpha: 1, A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32}
	}
	for _, layout := range []gpuctx.Layout{gpuctx.RowMajor, gpuctx.ColMajor} {
		C := upload(t, dev, cBytes)
		cases := []struct {
			name string
			call func(h gpuctx.Blas) error
			text []string
		}{
			{"strided A short", func(h gpuctx.Blas) error {
				return h.GemmStridedBatched(gemm(layout, buf(fa-1), buf(fb), C), count, sa, sb, sc)
			}, []string{"GemmStridedBatched", "A needs", fmt.Sprint(4 * fa), fmt.Sprint(4 * (fa - 1))}},
			{"strided B short", func(h gpuctx.Blas) error {
				return h.GemmStridedBatched(gemm(layout, buf(fa), buf(fb-1), C), count, sa, sb, sc)
			}, []string{"B needs", fmt.Sprint(4 * fb), fmt.Sprint(4 * (fb - 1))}},
			{"strided C short", func(h gpuctx.Blas) error {
				short, err := C.Slice(0, 4*(fc-1))
				if err != nil {
					return err
				}
				return h.GemmStridedBatched(gemm(layout, buf(fa), buf(fb), short), count, sa, sb, sc)
			}, []string{"C needs", fmt.Sprint(4 * fc), fmt.Sprint(4 * (fc - 1))}},
			{"strided B stride A's size", func(h gpuctx.Blas) error {
				// Strides that fit A but not B: the row-major mapping must not mix them up.
				return h.GemmStridedBatched(gemm(layout, buf(fa), buf(2*sa+20), C), count, sa, sb, sc)
			}, []string{"B needs"}},
			{"strided overflowing stride", func(h gpuctx.Blas) error {
				return h.GemmStridedBatched(gemm(layout, buf(fa), buf(fb), C), count, sa, math.MaxInt/2, sc)
			}, []string{"B needs"}},
			{"gemm overflowing ldb", func(h gpuctx.Blas) error {
				g := gemm(layout, buf(15), buf(20), C)
				g.LDB = math.MaxInt / 3
				return h.Gemm(g)
			}, []string{"B needs"}},
			{"grouped group 1 C short", func(h gpuctx.Blas) error {
				return h.GemmGrouped([]gpuctx.Gemm{gemm(layout, buf(15), buf(20), C), gemm(layout, buf(15), buf(20), buf(11))})
			}, []string{"group 1", "C needs"}},
			{"geam A short", func(h gpuctx.Blas) error {
				return h.Geam(gpuctx.Geam{Layout: layout, TransA: true, M: m, N: n, Alpha: 1, Beta: 1, A: buf(11), B: buf(12), C: C, Type: gpuctx.F32})
			}, []string{"Geam", "A needs"}},
		}
		for _, tc := range cases {
			err := ctx.Blas(tc.call)
			if !errors.Is(err, gpuctx.ErrInvalid) {
				t.Fatalf("%v %s: got %v, want ErrInvalid", layout, tc.name, err)
			}
			for _, w := range tc.text {
				if !strings.Contains(err.Error(), w) {
					t.Fatalf("%v %s: error %q does not mention %q", layout, tc.name, err, w)
				}
			}
		}
		must(t, "Stream.Synchronize after the rejected calls", s.Synchronize())
		sameBytes(t, fmt.Sprintf("%v: C after rejected calls", layout), download(t, dev, C), cBytes)
	}
}
