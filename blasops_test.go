package gpuctx_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/internal/blas"
	"github.com/gpuctx/gpuctx/internal/blastest"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// cpuDevice opens the CPU backend's device, closed at the end of the test.
func cpuDevice(t *testing.T) *gpuctx.Device {
	t.Helper()
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rt.Close() })
	d, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// encodeVals stores x as dtype dt (f32 or bf16) and returns the bytes and the
// values as stored (rounded to dt).
func encodeVals(dt gpuctx.DType, x []float64) ([]byte, []float64) {
	out := make([]byte, len(x)*dt.Size())
	got := make([]float64, len(x))
	for i, v := range x {
		switch dt {
		case gpuctx.F32:
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(float32(v)))
			got[i] = float64(float32(v))
		case gpuctx.BF16:
			h := half.BF16(float32(v))
			binary.LittleEndian.PutUint16(out[2*i:], h)
			got[i] = float64(half.FromBF16(h))
		default:
			panic(dt)
		}
	}
	return out, got
}

func decodeF32(b []byte) []float64 {
	x := make([]float64, len(b)/4)
	for i := range x {
		x[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
	}
	return x
}

func uploadBytes(t *testing.T, d *gpuctx.Device, b []byte) *gpuctx.Buffer {
	t.Helper()
	buf, err := d.Alloc(len(b))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = buf.Free() })
	if err := buf.CopyFromHost(b); err != nil {
		t.Fatal(err)
	}
	return buf
}

func downloadBytes(t *testing.T, b *gpuctx.Buffer) []byte {
	t.Helper()
	out := make([]byte, b.Size())
	if err := b.CopyToHost(out); err != nil {
		t.Fatal(err)
	}
	return out
}

func randVals(r *rand.Rand, n int) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = r.NormFloat64()
	}
	return x
}

// TestGemmStridedBatchedDistinctStrides runs strided batched GEMMs whose A, B
// and C strides all differ, in both layouts, with every transpose and padded
// leading dimensions, on buffers sized exactly for the batch, and compares the
// whole of C (the gaps between matrices included) with a float64 reference.
// Inputs must be unchanged. Before the row-major mapping swapped the strides
// with the operands, row-major results were wrong or the backend read outside A.
func TestGemmStridedBatchedDistinctStrides(t *testing.T) {
	d := cpuDevice(t)
	s := newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	r := rand.New(rand.NewPCG(7, 7))
	for _, layout := range []gpuctx.Layout{gpuctx.RowMajor, gpuctx.ColMajor} {
		for _, ab := range []gpuctx.DType{gpuctx.F32, gpuctx.BF16} {
			for _, ta := range []bool{false, true} {
				for _, tb := range []bool{false, true} {
					for _, sh := range []struct{ m, n, k, count int }{{3, 4, 5, 3}, {1, 7, 2, 4}, {6, 2, 9, 2}} {
						name := fmt.Sprintf("%v/%v-f32/ta=%v/tb=%v/%dx%dx%dx%d", layout, ab, ta, tb, sh.m, sh.n, sh.k, sh.count)
						t.Run(name, func(t *testing.T) {
							runStrided(t, d, ctx, s, r, layout, ab, ta, tb, sh.m, sh.n, sh.k, sh.count)
						})
					}
				}
			}
		}
	}
}

func runStrided(t *testing.T, d *gpuctx.Device, ctx *gpuctx.Context, s *gpuctx.Stream, r *rand.Rand,
	layout gpuctx.Layout, ab gpuctx.DType, ta, tb bool, m, n, k, count int) {
	t.Helper()
	g := blas.GemmShape{Layout: blas.Layout(layout), TransA: ta, TransB: tb, M: m, N: n, K: k, AB: hal.DType(ab), C: hal.F32,
		ALen: math.MaxInt, BLen: math.MaxInt, CLen: math.MaxInt}
	if err := g.Normalize(); err != nil {
		t.Fatal(err)
	}
	// Pad every leading dimension differently, then size each operand.
	g.LDA, g.LDB, g.LDC = g.LDA+1, g.LDB+3, g.LDC+2
	one := func(trans bool, r, c, ld int) int {
		if trans {
			r, c = c, r
		}
		if layout == gpuctx.ColMajor {
			return (c-1)*ld + r
		}
		return (r-1)*ld + c
	}
	na, nb, nc := one(ta, m, k, g.LDA), one(tb, k, n, g.LDB), one(false, m, n, g.LDC)
	strideA, strideB, strideC := na+2, nb+11, nc+5
	aBytes, aVals := encodeVals(ab, randVals(r, blas.Span(count, strideA, na)))
	bBytes, bVals := encodeVals(ab, randVals(r, blas.Span(count, strideB, nb)))
	cBytes, cVals := encodeVals(gpuctx.F32, randVals(r, blas.Span(count, strideC, nc)))
	A, B, C := uploadBytes(t, d, aBytes), uploadBytes(t, d, bBytes), uploadBytes(t, d, cBytes)
	const alpha, beta = 0.75, 0.5
	want := append([]float64(nil), cVals...)
	for i := range count {
		blastest.RefGemm(g, alpha, aVals[i*strideA:], bVals[i*strideB:], beta, want[i*strideC:])
	}
	err := ctx.Blas(func(h gpuctx.Blas) error {
		return h.GemmStridedBatched(gpuctx.Gemm{Layout: layout, TransA: ta, TransB: tb, M: m, N: n, K: k,
			Alpha: alpha, Beta: beta, A: A, B: B, C: C, LDA: g.LDA, LDB: g.LDB, LDC: g.LDC, AB: ab, CType: gpuctx.F32},
			count, strideA, strideB, strideC)
	})
	if err != nil {
		t.Fatalf("GemmStridedBatched: %v", err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatalf("Synchronize: %v", err)
	}
	got := decodeF32(downloadBytes(t, C))
	var maxErr float64
	for i := range want {
		if e := math.Abs(got[i] - want[i]); !(e <= maxErr) {
			maxErr = e
		}
	}
	if !(maxErr <= 1e-4) {
		t.Fatalf("max abs error %.3g against the float64 reference (strides A %d B %d C %d)", maxErr, strideA, strideB, strideC)
	}
	if !bytes.Equal(downloadBytes(t, A), aBytes) || !bytes.Equal(downloadBytes(t, B), bBytes) {
		t.Fatal("GemmStridedBatched changed an input")
	}
}

// TestBlasExtentChecks checks that every BLAS op rejects, before queueing,
// operands whose buffer is too short for what the backend would touch after the
// row-major mapping, naming the user's operand and the bytes needed and held,
// and that nothing is written.
func TestBlasExtentChecks(t *testing.T) {
	d := cpuDevice(t)
	s := newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	buf := func(n int) *gpuctx.Buffer { return uploadBytes(t, d, make([]byte, 4*n)) }
	const m, n, k, count = 3, 4, 5, 3
	// Row-major packed: A 3x5 (15), B 5x4 (20), C 3x4 (12).
	strideA, strideB, strideC := 17, 23, 13
	fullA, fullB, fullC := 2*strideA+15, 2*strideB+20, 2*strideC+12
	gemm := func(layout gpuctx.Layout, a, b, c *gpuctx.Buffer) gpuctx.Gemm {
		return gpuctx.Gemm{Layout: layout, M: m, N: n, K: k, Alpha: 1, A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32}
	}
	// Col-major packed: A 3x5 (15), B 5x4 (20), C 3x4 (12): same counts.
	type tc struct {
		name string
		call func(h gpuctx.Blas) error
		text []string
	}
	var cases []tc
	for _, layout := range []gpuctx.Layout{gpuctx.RowMajor, gpuctx.ColMajor} {
		cases = append(cases,
			tc{fmt.Sprintf("%v strided A short", layout), func(h gpuctx.Blas) error {
				return h.GemmStridedBatched(gemm(layout, buf(fullA-1), buf(fullB), buf(fullC)), count, strideA, strideB, strideC)
			}, []string{"Blas.GemmStridedBatched", "A needs", fmt.Sprint(4 * fullA), fmt.Sprint(4 * (fullA - 1))}},
			tc{fmt.Sprintf("%v strided B short", layout), func(h gpuctx.Blas) error {
				return h.GemmStridedBatched(gemm(layout, buf(fullA), buf(fullB-1), buf(fullC)), count, strideA, strideB, strideC)
			}, []string{"B needs", fmt.Sprint(4 * fullB), fmt.Sprint(4 * (fullB - 1))}},
			tc{fmt.Sprintf("%v strided C short", layout), func(h gpuctx.Blas) error {
				return h.GemmStridedBatched(gemm(layout, buf(fullA), buf(fullB), buf(fullC-1)), count, strideA, strideB, strideC)
			}, []string{"C needs", fmt.Sprint(4 * fullC), fmt.Sprint(4 * (fullC - 1))}},
			tc{fmt.Sprintf("%v strided huge stride", layout), func(h gpuctx.Blas) error {
				return h.GemmStridedBatched(gemm(layout, buf(fullA), buf(fullB), buf(fullC)), count, math.MaxInt/2, strideB, strideC)
			}, []string{"A needs"}},
			tc{fmt.Sprintf("%v gemm B short", layout), func(h gpuctx.Blas) error {
				return h.Gemm(gemm(layout, buf(15), buf(19), buf(12)))
			}, []string{"Blas.Gemm", "B needs 20 elements"}},
			tc{fmt.Sprintf("%v grouped group 1 A short", layout), func(h gpuctx.Blas) error {
				return h.GemmGrouped([]gpuctx.Gemm{gemm(layout, buf(15), buf(20), buf(12)), gemm(layout, buf(14), buf(20), buf(12))})
			}, []string{"group 1", "A needs 15 elements"}},
			tc{fmt.Sprintf("%v gemm huge ld", layout), func(h gpuctx.Blas) error {
				g := gemm(layout, buf(15), buf(20), buf(12))
				g.LDA = math.MaxInt / 2
				return h.Gemm(g)
			}, []string{"A needs"}},
			tc{fmt.Sprintf("%v geam B short", layout), func(h gpuctx.Blas) error {
				return h.Geam(gpuctx.Geam{Layout: layout, TransB: true, M: m, N: n, Alpha: 1, Beta: 1, A: buf(12), B: buf(11), C: buf(12), Type: gpuctx.F32})
			}, []string{"Blas.Geam", "B needs 12 elements"}},
		)
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := ctx.Blas(c.call)
			if !errors.Is(err, gpuctx.ErrInvalid) {
				t.Fatalf("want ErrInvalid, got %v", err)
			}
			for _, w := range c.text {
				if !strings.Contains(err.Error(), w) {
					t.Fatalf("error %q does not mention %q", err, w)
				}
			}
		})
	}
	if err := s.Synchronize(); err != nil {
		t.Fatalf("a rejected call reached the stream: %v", err)
	}
}

// TestAllocOutOfMemory: an absurd allocation on the CPU backend is an error
// that matches gpuctx.ErrOutOfMemory (as CUDA's is), not a dead process.
func TestAllocOutOfMemory(t *testing.T) {
	d := cpuDevice(t)
	for _, n := range []int{1 << 40, 1 << 50, math.MaxInt} {
		if b, err := d.Alloc(n); !errors.Is(err, gpuctx.ErrOutOfMemory) {
			t.Fatalf("Alloc(%d) = %v, %v; want ErrOutOfMemory", n, b, err)
		}
		if _, err := d.AllocHost(n); !errors.Is(err, gpuctx.ErrOutOfMemory) {
			t.Fatalf("AllocHost(%d): %v; want ErrOutOfMemory", n, err)
		}
	}
	if b, err := d.Alloc(1 << 20); err != nil {
		t.Fatalf("a small Alloc after the failures: %v", err)
	} else {
		_ = b.Free()
	}
}

// TestGemmStridedBatchedOverlappingC: a batch whose C matrices overlap
// (strideC smaller than one C matrix) has undefined results on cuBLAS and is
// rejected; a batch with no output (m or n zero) is a no-op whatever its count.
func TestGemmStridedBatchedOverlappingC(t *testing.T) {
	d := cpuDevice(t)
	s := newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	buf := func(n int) *gpuctx.Buffer { return uploadBytes(t, d, make([]byte, 4*n)) }
	g := gpuctx.Gemm{M: 2, N: 2, K: 2, Alpha: 1, A: buf(12), B: buf(12), C: buf(64), AB: gpuctx.F32, CType: gpuctx.F32}
	err := ctx.Blas(func(h gpuctx.Blas) error { return h.GemmStridedBatched(g, 3, 4, 4, 3) })
	if !errors.Is(err, gpuctx.ErrInvalid) || !strings.Contains(err.Error(), "strideC=3") {
		t.Fatalf("overlapping C: got %v, want ErrInvalid naming strideC", err)
	}
	g.M = 0
	if err := ctx.Blas(func(h gpuctx.Blas) error { return h.GemmStridedBatched(g, math.MaxInt32, 0, 0, 0) }); err != nil {
		t.Fatalf("empty batch: %v", err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
}
