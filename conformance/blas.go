package conformance

import (
	"errors"
	"fmt"
	"math"
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

// TestBlasStridedBatched runs f32 strided batched GEMMs whose A, B and C
// strides all differ, in both layouts, with every transpose and padded leading
// dimensions, on buffers sized exactly for the batch. Inputs are small
// integers, so every result is exact: C (the gaps between its matrices
// included) must equal the host reference bit for bit, and A and B must be
// unchanged.
func TestBlasStridedBatched(t *testing.T, dev *gpuctx.Device) {
	s := newStream(t, dev)
	ctx := newBlasContext(t, dev, s)
	r := newRand(t)
	const m, n, k, count = 5, 3, 4, 3
	for _, layout := range []gpuctx.Layout{gpuctx.RowMajor, gpuctx.ColMajor} {
		for _, ta := range []bool{false, true} {
			for _, tb := range []bool{false, true} {
				am, bm, cm := gemmMats(layout, ta, tb, m, n, k, [3]int{1, 2, 3})
				sa, sb, sc := am.span()+3, bm.span()+8, cm.span()+1
				a := randInts(r, (count-1)*sa+am.span(), -3, 3)
				b := randInts(r, (count-1)*sb+bm.span(), -3, 3)
				c := randInts(r, (count-1)*sc+cm.span(), -3, 3)
				A, B, C := upload(t, dev, f32Bytes(a)), upload(t, dev, f32Bytes(b)), upload(t, dev, f32Bytes(c))
				const alpha, beta = 0.5, 0.25
				want := make([]float64, len(c))
				for i, v := range c {
					want[i] = float64(v)
				}
				a64, b64 := make([]float64, len(a)), make([]float64, len(b))
				for i, v := range a {
					a64[i] = float64(v)
				}
				for i, v := range b {
					b64[i] = float64(v)
				}
				for i := range count {
					refGemm(ta, tb, m, n, k, alpha, am, a64[i*sa:], bm, b64[i*sb:], beta, cm, want[i*sc:])
				}
				wantF := make([]float32, len(want))
				for i, v := range want {
					wantF[i] = float32(v)
				}
				what := fmt.Sprintf("%v ta=%v tb=%v strides A %d B %d C %d", layout, ta, tb, sa, sb, sc)
				must(t, what, ctx.Blas(func(h gpuctx.Blas) error {
					return h.GemmStridedBatched(gpuctx.Gemm{Layout: layout, TransA: ta, TransB: tb, M: m, N: n, K: k,
						Alpha: alpha, Beta: beta, A: A, B: B, C: C, LDA: am.ld, LDB: bm.ld, LDC: cm.ld, AB: gpuctx.F32, CType: gpuctx.F32},
						count, sa, sb, sc)
				}))
				sameF32(t, what+": C", bytesF32(download(t, dev, C)), wantF)
				sameBytes(t, what+": A unchanged", download(t, dev, A), f32Bytes(a))
				sameBytes(t, what+": B unchanged", download(t, dev, B), f32Bytes(b))
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
