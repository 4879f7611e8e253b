package cpu

import (
	"errors"
	"fmt"
	"math"
	"math/cmplx"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// gemmData is a GEMM's operands as stored on the device, as float64.
type gemmData struct{ a, b, c []float64 }

// setupGemm allocates and fills A, B and C for g (shape, lds and dtypes set),
// stores the pointers in g and returns the stored values.
func setupGemm(t testing.TB, d *device, g *hal.GemmDesc, seed lcg) gemmData {
	t.Helper()
	ra, ca := dims(g.TransA, g.M, g.K)
	rb, cb := dims(g.TransB, g.K, g.N)
	var x gemmData
	var bytes []byte
	bytes, x.a = encode(g.AB, seed.vals(extent(ra, ca, g.LDA)))
	g.A = upload(t, d, bytes)
	bytes, x.b = encode(g.AB, seed.vals(extent(rb, cb, g.LDB)))
	g.B = upload(t, d, bytes)
	bytes, x.c = encode(g.CType, seed.vals(extent(g.M, g.N, g.LDC)))
	g.C = upload(t, d, bytes)
	return x
}

// refGemm is the float64 column-major reference; it returns the whole C extent.
func refGemm(g hal.GemmDesc, x gemmData) []float64 {
	c := append([]float64(nil), x.c...)
	for j := range g.N {
		for i := range g.M {
			var sum float64
			for l := range g.K {
				ai, bi := i+l*g.LDA, l+j*g.LDB
				if g.TransA == hal.Trans {
					ai = l + i*g.LDA
				}
				if g.TransB == hal.Trans {
					bi = j + l*g.LDB
				}
				av, bv := x.a[ai], x.b[bi]
				sum += av * bv
			}
			old := 0.0
			if g.Beta != 0 {
				old = g.Beta * c[i+j*g.LDC]
			}
			c[i+j*g.LDC] = g.Alpha*sum + old
		}
	}
	return c
}

func tolFor(ct hal.DType) float64 {
	switch ct {
	case hal.F64:
		return 1e-12
	case hal.F32:
		return 1e-5
	}
	return 2e-2
}

// checkGemm compares C on the device with the reference, including the padding
// rows between M and LDC, which must be untouched.
func checkGemm(t testing.TB, d *device, g hal.GemmDesc, x gemmData) {
	t.Helper()
	got := decode(g.CType, download(t, d, g.C, len(x.c)*g.CType.Size()))
	want := refGemm(g, x)
	if e := relErr(got, want); e > tolFor(g.CType) || math.IsNaN(e) {
		t.Fatalf("%v: relative error %.3g > %.3g", g.CType, e, tolFor(g.CType))
	}
	for j := range g.N {
		for i := g.M; i < g.LDC && i+j*g.LDC < len(x.c); i++ {
			if got[i+j*g.LDC] != x.c[i+j*g.LDC] {
				t.Fatalf("padding element (%d,%d) of C changed", i, j)
			}
		}
	}
}

func boundHandle(t testing.TB, d *device, s *stream) *blasHandle {
	t.Helper()
	h, err := d.NewBlasHandle()
	if err != nil {
		t.Fatal(err)
	}
	if err := h.SetStream(s); err != nil {
		t.Fatal(err)
	}
	return h.(*blasHandle)
}

var typePairs = []struct{ ab, c hal.DType }{
	{hal.F32, hal.F32}, {hal.F64, hal.F64}, {hal.F16, hal.F16}, {hal.F16, hal.F32}, {hal.BF16, hal.BF16}, {hal.BF16, hal.F32},
}

func TestGemm(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	h := boundHandle(t, d, s)
	lt, _ := d.NewLtHandle()
	for _, tp := range typePairs {
		for _, ta := range []hal.Op{hal.NoTrans, hal.Trans} {
			for _, tb := range []hal.Op{hal.NoTrans, hal.Trans} {
				for _, viaLt := range []bool{false, true} {
					if viaLt && tp.ab == hal.F64 {
						continue
					}
					name := fmt.Sprintf("%v-%v/%d%d/lt=%v", tp.ab, tp.c, ta, tb, viaLt)
					t.Run(name, func(t *testing.T) {
						const m, n, k = 7, 5, 9
						ra, _ := dims(ta, m, k)
						rb, _ := dims(tb, k, n)
						g := hal.GemmDesc{TransA: ta, TransB: tb, M: m, N: n, K: k, Alpha: 1.5, Beta: -0.5,
							LDA: ra + 3, LDB: rb + 1, LDC: m + 2, AB: tp.ab, CType: tp.c}
						x := setupGemm(t, d, &g, lcg(len(name)))
						var err error
						if viaLt {
							err = lt.Matmul(s, g, 0, 0)
						} else {
							err = h.Gemm(g)
						}
						if err != nil {
							t.Fatal(err)
						}
						if err := s.Synchronize(); err != nil {
							t.Fatal(err)
						}
						checkGemm(t, d, g, x)
					})
				}
			}
		}
	}
}

func TestGemmEdgeCases(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	h := boundHandle(t, d, s)
	tests := []struct {
		name string
		g    hal.GemmDesc
		nanC bool
	}{
		{"beta 0 ignores NaN in C", hal.GemmDesc{M: 3, N: 4, K: 2, Alpha: 1, LDA: 3, LDB: 2, LDC: 3, AB: hal.F32, CType: hal.F32}, true},
		{"k 0 scales C", hal.GemmDesc{M: 3, N: 4, K: 0, Alpha: 1, Beta: 2, LDA: 3, LDB: 1, LDC: 3, AB: hal.F32, CType: hal.F32}, false},
		{"alpha 0", hal.GemmDesc{M: 3, N: 4, K: 5, Alpha: 0, Beta: -1, LDA: 3, LDB: 5, LDC: 4, AB: hal.BF16, CType: hal.F32}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := tc.g
			if g.K == 0 {
				// No A or B to allocate; only C.
				var bytes []byte
				var x gemmData
				seed := lcg(3)
				bytes, x.c = encode(g.CType, seed.vals(extent(g.M, g.N, g.LDC)))
				g.C = upload(t, d, bytes)
				if err := h.Gemm(g); err != nil {
					t.Fatal(err)
				}
				if err := s.Synchronize(); err != nil {
					t.Fatal(err)
				}
				checkGemm(t, d, g, x)
				return
			}
			x := setupGemm(t, d, &g, lcg(7))
			if tc.nanC {
				nan := make([]float32, len(x.c))
				for i := range nan {
					nan[i] = float32(math.NaN())
				}
				if err := d.CopyHtoD(g.C, ptrOf(nan), 4*len(nan)); err != nil {
					t.Fatal(err)
				}
			}
			if err := h.Gemm(g); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			checkGemm(t, d, g, x)
		})
	}
	// Bad descriptors are rejected before queueing.
	bad := []hal.GemmDesc{
		{M: 2, N: 2, K: 2, LDA: 1, LDB: 2, LDC: 2, AB: hal.F32, CType: hal.F32},
		{M: 2, N: 2, K: 2, LDA: 2, LDB: 2, LDC: 2, AB: hal.F32, CType: hal.F16},
		{M: -1, N: 2, K: 2, LDA: 2, LDB: 2, LDC: 2, AB: hal.F32, CType: hal.F32},
	}
	for i, g := range bad {
		if err := h.Gemm(g); err == nil {
			t.Errorf("bad desc %d: want an error", i)
		}
	}
	// No bound stream.
	h2, _ := d.NewBlasHandle()
	if err := h2.Gemm(tests[0].g); err == nil {
		t.Error("Gemm on a handle bound to no stream: want an error")
	}
	// Unallocated C fails asynchronously, sticky.
	g := hal.GemmDesc{M: 2, N: 2, K: 2, Alpha: 1, LDA: 2, LDB: 2, LDC: 2, AB: hal.F32, CType: hal.F32}
	setupGemm(t, d, &g, lcg(1))
	g.C += 1 << 40
	s2 := newTestStream(t, d)
	h3 := boundHandle(t, d, s2)
	if err := h3.Gemm(g); err != nil {
		t.Fatal(err)
	}
	if err := s2.Synchronize(); err == nil {
		t.Error("Gemm into unallocated C: want a sticky error")
	}
}

func TestGemmStridedBatched(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	h := boundHandle(t, d, s)
	for _, tp := range typePairs {
		t.Run(fmt.Sprintf("%v-%v", tp.ab, tp.c), func(t *testing.T) {
			const count = 3
			g := hal.GemmDesc{TransA: hal.Trans, M: 4, N: 3, K: 5, Alpha: 0.75, Beta: 0.5,
				LDA: 6, LDB: 5, LDC: 4, AB: tp.ab, CType: tp.c}
			b := hal.StridedBatch{Count: count, StrideA: 6*4 + 2, StrideB: 5*3 + 1, StrideC: 4*3 + 5}
			// One buffer per operand covers every batch entry.
			var x gemmData
			var bytes []byte
			seed := lcg(11)
			bytes, x.a = encode(tp.ab, seed.vals(int(b.StrideA)*count))
			g.A = upload(t, d, bytes)
			bytes, x.b = encode(tp.ab, seed.vals(int(b.StrideB)*count))
			g.B = upload(t, d, bytes)
			bytes, x.c = encode(tp.c, seed.vals(int(b.StrideC)*count))
			g.C = upload(t, d, bytes)
			if err := h.GemmStridedBatched(g, b); err != nil {
				t.Fatal(err)
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			got := decode(tp.c, download(t, d, g.C, len(x.c)*tp.c.Size()))
			for i := range count {
				xi := gemmData{x.a[i*int(b.StrideA):], x.b[i*int(b.StrideB):], x.c[i*int(b.StrideC) : (i+1)*int(b.StrideC)]}
				want := refGemm(g, xi)
				if e := relErr(got[i*int(b.StrideC):(i+1)*int(b.StrideC)], want); e > tolFor(tp.c) {
					t.Fatalf("batch %d: relative error %.3g", i, e)
				}
			}
		})
	}
}

func TestGemmGrouped(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	h := boundHandle(t, d, s)
	if h.GroupedNative() {
		t.Error("GroupedNative = true, want false on the CPU")
	}
	shapes := [][3]int{{3, 4, 5}, {8, 1, 2}, {1, 6, 7}, {0, 3, 3}}
	ds := make([]hal.GemmDesc, len(shapes))
	xs := make([]gemmData, len(shapes))
	for i, sh := range shapes {
		ds[i] = hal.GemmDesc{TransB: hal.Trans, M: sh[0], N: sh[1], K: sh[2], Alpha: 2, Beta: 1,
			LDA: max(1, sh[0]), LDB: sh[1], LDC: max(1, sh[0]), AB: hal.BF16, CType: hal.F32}
		if sh[0] == 0 {
			ds[i].A, ds[i].C = 0, 0 // nothing to compute, nothing read
			ds[i].B = 0
			continue
		}
		xs[i] = setupGemm(t, d, &ds[i], lcg(i+1))
	}
	if err := h.GemmGrouped(ds); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	for i := range ds {
		if shapes[i][0] > 0 {
			checkGemm(t, d, ds[i], xs[i])
		}
	}
}

func TestGeam(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	h := boundHandle(t, d, s)
	alpha, beta := complex(1.5, 0.5), complex(-0.25, 2)
	for _, dt := range []hal.DType{hal.F32, hal.F64, hal.C64, hal.C128} {
		for _, ta := range []hal.Op{hal.NoTrans, hal.Trans} {
			for _, tb := range []hal.Op{hal.NoTrans, hal.Trans} {
				for _, inPlace := range []bool{false, true} {
					if inPlace && ta == hal.Trans {
						continue
					}
					t.Run(fmt.Sprintf("%v/%d%d/inplace=%v", dt, ta, tb, inPlace), func(t *testing.T) {
						const m, n = 4, 3
						ra, ca := dims(ta, m, n)
						rb, cb := dims(tb, m, n)
						g := hal.GeamDesc{TransA: ta, TransB: tb, M: m, N: n, Alpha: alpha, Beta: beta,
							LDA: ra + 1, LDB: rb + 2, LDC: m + 1, Type: dt}
						if inPlace {
							g.LDA = g.LDC
						}
						seed := lcg(5)
						a := randComplex(&seed, dt, extent(ra, ca, g.LDA))
						b := randComplex(&seed, dt, extent(rb, cb, g.LDB))
						c := randComplex(&seed, dt, extent(m, n, g.LDC))
						g.A, g.B = upload(t, d, encodeC(dt, a)), upload(t, d, encodeC(dt, b))
						g.C = upload(t, d, encodeC(dt, c))
						if inPlace {
							g.C = g.A
							c = a
						}
						if err := h.Geam(g); err != nil {
							t.Fatal(err)
						}
						if err := s.Synchronize(); err != nil {
							t.Fatal(err)
						}
						al, be := alpha, beta
						if dt == hal.F32 || dt == hal.F64 {
							al, be = complex(real(alpha), 0), complex(real(beta), 0)
						}
						got := decodeC(dt, download(t, d, g.C, len(c)*dt.Size()))
						tol := 1e-6
						if dt == hal.F64 || dt == hal.C128 {
							tol = 1e-14
						}
						for j := range n {
							for i := range g.LDC {
								if i+j*g.LDC >= len(c) {
									break
								}
								want := c[i+j*g.LDC]
								if i < m {
									ai, bi := i+j*g.LDA, i+j*g.LDB
									if ta == hal.Trans {
										ai = j + i*g.LDA
									}
									if tb == hal.Trans {
										bi = j + i*g.LDB
									}
									want = al*a[ai] + be*b[bi]
								}
								if cmplx.Abs(got[i+j*g.LDC]-want) > tol*4 {
									t.Fatalf("C(%d,%d) = %v, want %v", i, j, got[i+j*g.LDC], want)
								}
							}
						}
					})
				}
			}
		}
	}
	if err := h.Geam(hal.GeamDesc{M: 1, N: 1, LDA: 1, LDB: 1, LDC: 1, Type: hal.F16}); err == nil {
		t.Error("Geam f16: want an error")
	}
}

// randComplex returns values representable in dt (real for f32/f64).
func randComplex(r *lcg, dt hal.DType, n int) []complex128 {
	v := make([]complex128, n)
	for i := range v {
		re, im := r.next(), r.next()
		switch dt {
		case hal.F32:
			v[i] = complex(float64(float32(re)), 0)
		case hal.F64:
			v[i] = complex(re, 0)
		case hal.C64:
			v[i] = complex(float64(float32(re)), float64(float32(im)))
		default:
			v[i] = complex(re, im)
		}
	}
	return v
}

func encodeC(dt hal.DType, v []complex128) []byte {
	switch dt {
	case hal.F32:
		o := make([]float32, len(v))
		for i, x := range v {
			o[i] = float32(real(x))
		}
		return asBytes(o)
	case hal.F64:
		o := make([]float64, len(v))
		for i, x := range v {
			o[i] = real(x)
		}
		return asBytes(o)
	case hal.C64:
		o := make([]complex64, len(v))
		for i, x := range v {
			o[i] = complex64(x)
		}
		return asBytes(o)
	}
	return asBytes(append([]complex128(nil), v...))
}

func decodeC(dt hal.DType, b []byte) []complex128 {
	var out []complex128
	switch dt {
	case hal.F32:
		for _, x := range fromBytes[float32](b) {
			out = append(out, complex(float64(x), 0))
		}
	case hal.F64:
		for _, x := range fromBytes[float64](b) {
			out = append(out, complex(x, 0))
		}
	case hal.C64:
		for _, x := range fromBytes[complex64](b) {
			out = append(out, complex128(x))
		}
	default:
		out = fromBytes[complex128](b)
	}
	return out
}

// splitKDesc is a GEMM that qualifies for split-K (K >= 1024, K >= 8*max(M,N)).
func splitKDesc(ta, tb hal.Op, ab, ct hal.DType) hal.GemmDesc {
	const m, n, k = 8, 6, 2048
	ra, _ := dims(ta, m, k)
	rb, _ := dims(tb, k, n)
	return hal.GemmDesc{TransA: ta, TransB: tb, M: m, N: n, K: k, Alpha: 0.5, Beta: 2,
		LDA: ra + 1, LDB: rb, LDC: m + 1, AB: ab, CType: ct}
}

func TestSplitK(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	ws, _ := d.Alloc(4 * 8 * 6 * 8) // 4 splits of an 8x6 f64 partial
	tests := []struct {
		name      string
		g         hal.GemmDesc
		wsSize    int
		rebind    bool // SetStream after SetWorkspace: resets the workspace, like cuBLAS
		lt        bool
		wantSplit bool
	}{
		{"f32 NN", splitKDesc(hal.NoTrans, hal.NoTrans, hal.F32, hal.F32), 4 * 8 * 6 * 4, false, false, true},
		{"f32 TT", splitKDesc(hal.Trans, hal.Trans, hal.F32, hal.F32), 4 * 8 * 6 * 4, false, false, true},
		{"f64 NT", splitKDesc(hal.NoTrans, hal.Trans, hal.F64, hal.F64), 4 * 8 * 6 * 8, false, false, true},
		{"bf16 TN 2 splits", splitKDesc(hal.Trans, hal.NoTrans, hal.BF16, hal.F32), 2 * 8 * 6 * 4, false, false, true},
		{"f16 lt", splitKDesc(hal.NoTrans, hal.NoTrans, hal.F16, hal.F16), 4 * 8 * 6 * 4, false, true, true},
		{"workspace too small", splitKDesc(hal.NoTrans, hal.NoTrans, hal.F32, hal.F32), 8 * 6 * 4, false, false, false},
		{"no workspace", splitKDesc(hal.NoTrans, hal.NoTrans, hal.F32, hal.F32), 0, false, false, false},
		{"SetStream resets workspace", splitKDesc(hal.NoTrans, hal.NoTrans, hal.F32, hal.F32), 4 * 8 * 6 * 4, true, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			g := tc.g
			x := setupGemm(t, d, &g, lcg(len(tc.name)))
			before := d.splitKOps.Load()
			wsp := ws
			if tc.wsSize == 0 {
				wsp = 0
			}
			if tc.lt {
				lt, _ := d.NewLtHandle()
				if err := lt.Matmul(s, g, wsp, tc.wsSize); err != nil {
					t.Fatal(err)
				}
			} else {
				h := boundHandle(t, d, s)
				if err := h.SetWorkspace(wsp, tc.wsSize); err != nil {
					t.Fatal(err)
				}
				if tc.rebind {
					if err := h.SetStream(s); err != nil {
						t.Fatal(err)
					}
					// The workspace is gone: a GEMM now is refused (cuBLAS would
					// run it on its default pool) until one is set, here none.
					if err := h.Gemm(g); !errors.Is(err, ErrHandleMisuse) {
						t.Fatalf("Gemm after SetStream dropped the workspace: err %v, want ErrHandleMisuse", err)
					}
					if err := h.SetWorkspace(0, 0); err != nil {
						t.Fatal(err)
					}
				}
				if err := h.Gemm(g); err != nil {
					t.Fatal(err)
				}
			}
			if err := s.Synchronize(); err != nil {
				t.Fatal(err)
			}
			if got := d.splitKOps.Load() - before; got != map[bool]int64{true: 1, false: 0}[tc.wantSplit] {
				t.Errorf("split-K GEMMs = %d, want split-K %v", got, tc.wantSplit)
			}
			checkGemm(t, d, g, x)
		})
	}
	if d.WorkspaceConflicts() != 0 {
		t.Errorf("WorkspaceConflicts = %d on one stream, want 0", d.WorkspaceConflicts())
	}
}

// TestWorkspaceConflicts runs one split-K GEMM on each of two streams and
// holds both inside their workspace until both have arrived (so they provably
// overlap), with one shared workspace and with one per stream.
func TestWorkspaceConflicts(t *testing.T) {
	tests := []struct {
		name          string
		shared        bool
		sameStream    bool
		wantConflicts int64
	}{
		{"shared workspace, two streams", true, false, 1},
		{"workspace per stream", false, false, 0},
		{"shared workspace, one stream", true, true, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newTestDevice(t)
			var arrived atomic.Int32
			var timedOut atomic.Bool
			both := make(chan struct{})
			if !tc.sameStream {
				d.wsHook = func() {
					if arrived.Add(1) == 2 {
						close(both)
					}
					select {
					case <-both:
					case <-time.After(10 * time.Second):
						timedOut.Store(true)
					}
				}
			}
			s1 := newTestStream(t, d)
			s2 := s1
			if !tc.sameStream {
				s2 = newTestStream(t, d)
			}
			const wsSize = 4 * 8 * 6 * 4
			ws1, _ := d.Alloc(wsSize)
			ws2 := ws1
			if !tc.shared {
				ws2, _ = d.Alloc(wsSize)
			}
			var gs [2]hal.GemmDesc
			var xs [2]gemmData
			for i, st := range []*stream{s1, s2} {
				gs[i] = splitKDesc(hal.NoTrans, hal.NoTrans, hal.F32, hal.F32)
				xs[i] = setupGemm(t, d, &gs[i], lcg(100+i))
				h := boundHandle(t, d, st)
				if err := h.SetWorkspace([]hal.Ptr{ws1, ws2}[i], wsSize); err != nil {
					t.Fatal(err)
				}
				if err := h.Gemm(gs[i]); err != nil {
					t.Fatal(err)
				}
			}
			within(t, "two split-K GEMMs", func() {
				if err := d.Synchronize(); err != nil {
					t.Error(err)
				}
			})
			if timedOut.Load() {
				t.Fatal("the two streams' GEMMs never held their workspaces at the same time")
			}
			if got := d.WorkspaceConflicts(); got != tc.wantConflicts {
				t.Errorf("WorkspaceConflicts = %d, want %d", got, tc.wantConflicts)
			}
			if d.splitKOps.Load() != 2 {
				t.Errorf("split-K GEMMs = %d, want 2", d.splitKOps.Load())
			}
			if tc.wantConflicts == 0 {
				for i := range gs {
					checkGemm(t, d, gs[i], xs[i])
				}
			}
		})
	}
}

// TestTF32 checks that MathTF32 rounds f32 inputs to a 10-bit mantissa:
// the result matches a reference on rounded inputs and differs measurably
// from the default.
func TestTF32(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	g := hal.GemmDesc{M: 16, N: 16, K: 16, Alpha: 1, LDA: 16, LDB: 16, LDC: 16, AB: hal.F32, CType: hal.F32}
	x := setupGemm(t, d, &g, lcg(9))
	results := map[hal.MathMode][]float64{}
	for _, mode := range []hal.MathMode{hal.MathDefault, hal.MathTF32} {
		h := boundHandle(t, d, s)
		if err := h.SetMathMode(mode); err != nil {
			t.Fatal(err)
		}
		if err := h.Gemm(g); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatal(err)
		}
		results[mode] = decode(hal.F32, download(t, d, g.C, 16*16*4))
	}
	exact := refGemm(g, x)
	rx := gemmData{a: make([]float64, len(x.a)), b: make([]float64, len(x.b)), c: x.c}
	for i := range x.a {
		rx.a[i] = float64(roundTF32(float32(x.a[i])))
		rx.b[i] = float64(roundTF32(float32(x.b[i])))
	}
	rounded := refGemm(g, rx)
	if e := relErr(results[hal.MathDefault], exact); e > 1e-5 {
		t.Errorf("default math: relative error %.3g vs exact", e)
	}
	if e := relErr(results[hal.MathTF32], rounded); e > 1e-5 {
		t.Errorf("TF32: relative error %.3g vs reference on TF32-rounded inputs", e)
	}
	if e := relErr(results[hal.MathTF32], exact); e < 1e-5 {
		t.Errorf("TF32 result is within %.3g of exact f32: the math mode has no effect", e)
	}
}

func TestRounding(t *testing.T) {
	tests := []struct {
		name string
		got  uint32
		want uint32
	}{
		{"bf16 1", uint32(f32ToBF16(1)), 0x3f80},
		{"bf16 tie to even down", uint32(f32ToBF16(1 + 1.0/256)), 0x3f80},
		{"bf16 tie to even up", uint32(f32ToBF16(1 + 3.0/256)), 0x3f82},
		{"bf16 above tie", uint32(f32ToBF16(1 + 1.0/256 + 1.0/4096)), 0x3f81},
		{"bf16 NaN", uint32(f32ToBF16(float32(math.NaN()))) & 0x7fc0, 0x7fc0},
		{"tf32 tie to even", math.Float32bits(roundTF32(1 + 1.0/2048)), math.Float32bits(1)},
		{"tf32 tie up", math.Float32bits(roundTF32(1 + 3.0/2048)), math.Float32bits(1 + 1.0/512)},
		{"tf32 inf", math.Float32bits(roundTF32(float32(math.Inf(1)))), 0x7f800000},
	}
	for _, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("%s: got %#x, want %#x", tc.name, tc.got, tc.want)
		}
	}
}

func BenchmarkGemm256F32(b *testing.B) {
	d := newTestDevice(b)
	s := newTestStream(b, d)
	h := boundHandle(b, d, s)
	g := hal.GemmDesc{M: 256, N: 256, K: 256, Alpha: 1, LDA: 256, LDB: 256, LDC: 256, AB: hal.F32, CType: hal.F32}
	setupGemm(b, d, &g, lcg(1))
	for b.Loop() {
		if err := h.Gemm(g); err != nil {
			b.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(2*256*256*256*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}
