package cublas

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/dynload"
	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/x448/float16"
)

// This file holds the GPU tests. They load libcuda themselves with a minimal
// set of driver symbols and skip cleanly where libcuda, a device or cuBLAS is
// missing.

type testDriver struct {
	init           func(flags uint32) int32
	deviceGet      func(d *int32, ordinal int32) int32
	deviceAttr     func(v *int32, attr, dev int32) int32
	primaryRetain  func(ctx *uintptr, dev int32) int32
	primaryRelease func(dev int32) int32
	ctxSetCurrent  func(ctx uintptr) int32
	memAlloc       func(p *uintptr, n uint64) int32
	memFree        func(p uintptr) int32
	memcpyHtoD     func(dst uintptr, src unsafe.Pointer, n uint64) int32
	memcpyDtoH     func(dst unsafe.Pointer, src uintptr, n uint64) int32
	memsetD8       func(dst uintptr, v uint8, n uint64) int32
	streamCreate   func(s *uintptr, flags uint32) int32
	streamSync     func(s uintptr) int32
	streamDestroy  func(s uintptr) int32
	ctxSync        func() int32
}

// gpu is one test's CUDA environment: device 0's primary context, a runner
// that makes it current, the loaded Lib and a stream.
type gpu struct {
	t            *testing.T
	d            testDriver
	drv          *dynload.Library
	dev          int32
	ctx          uintptr
	major, minor int
	lib          *Lib
	stream       uintptr
}

// Do implements hal.Runner: it pins the goroutine to its thread and makes the
// primary context current.
func (g *gpu) Do(fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if rc := g.d.ctxSetCurrent(g.ctx); rc != 0 {
		return fmt.Errorf("cuCtxSetCurrent: %d", rc)
	}
	return fn()
}

// check fails the test if a driver call failed.
func (g *gpu) check(call string, rc int32) {
	g.t.Helper()
	if rc != 0 {
		g.t.Fatalf("%s: CUresult %d", call, rc)
	}
}

func newGPU(t *testing.T) *gpu {
	t.Helper()
	g := &gpu{t: t}
	var err error
	g.drv, err = dynload.Open(dynload.Spec{Name: "CUDA driver", Sonames: []string{"libcuda.so.1"}})
	if err != nil {
		t.Skipf("no CUDA driver, GPU test skipped: %v", err)
	}
	d := &g.d
	if err := g.drv.Bind([]dynload.Symbol{
		{Name: "cuInit", Fn: &d.init},
		{Name: "cuDeviceGet", Fn: &d.deviceGet},
		{Name: "cuDeviceGetAttribute", Fn: &d.deviceAttr},
		{Name: "cuDevicePrimaryCtxRetain", Fn: &d.primaryRetain},
		{Name: "cuDevicePrimaryCtxRelease_v2", Fn: &d.primaryRelease},
		{Name: "cuCtxSetCurrent", Fn: &d.ctxSetCurrent},
		{Name: "cuMemAlloc_v2", Fn: &d.memAlloc},
		{Name: "cuMemFree_v2", Fn: &d.memFree},
		{Name: "cuMemcpyHtoD_v2", Fn: &d.memcpyHtoD},
		{Name: "cuMemcpyDtoH_v2", Fn: &d.memcpyDtoH},
		{Name: "cuMemsetD8_v2", Fn: &d.memsetD8},
		{Name: "cuStreamCreate", Fn: &d.streamCreate},
		{Name: "cuStreamSynchronize", Fn: &d.streamSync},
		{Name: "cuStreamDestroy_v2", Fn: &d.streamDestroy},
		{Name: "cuCtxSynchronize", Fn: &d.ctxSync},
	}); err != nil {
		g.drv.Close()
		t.Fatalf("binding the driver: %v", err)
	}
	if rc := d.init(0); rc != 0 {
		g.drv.Close()
		t.Skipf("cuInit failed (%d): no usable GPU, GPU test skipped", rc)
	}
	if rc := d.deviceGet(&g.dev, 0); rc != 0 {
		g.drv.Close()
		t.Skipf("no CUDA device 0 (%d), GPU test skipped", rc)
	}
	var v int32
	g.check("cuDeviceGetAttribute", d.deviceAttr(&v, 75, g.dev))
	g.major = int(v)
	g.check("cuDeviceGetAttribute", d.deviceAttr(&v, 76, g.dev))
	g.minor = int(v)
	g.check("cuDevicePrimaryCtxRetain", d.primaryRetain(&g.ctx, g.dev))
	g.lib, err = Load()
	if err != nil {
		d.primaryRelease(g.dev)
		g.drv.Close()
		t.Skipf("cuBLAS not loadable, GPU test skipped: %v", err)
	}
	g.Do(func() error {
		g.check("cuStreamCreate", d.streamCreate(&g.stream, 1)) // CU_STREAM_NON_BLOCKING
		return nil
	})
	t.Cleanup(func() {
		g.Do(func() error {
			g.check("cuCtxSynchronize", d.ctxSync())
			g.check("cuStreamDestroy_v2", d.streamDestroy(g.stream))
			return nil
		})
		if err := g.lib.Close(); err != nil {
			t.Errorf("Lib.Close: %v", err)
		}
		d.primaryRelease(g.dev)
		g.drv.Close()
	})
	libs := g.lib.Libraries()
	t.Logf("backend cuda: device 0 compute %d.%d; %s %s at %s; %s %s at %s", g.major, g.minor,
		libs[0].Name, libs[0].Version, libs[0].Path, libs[1].Name, libs[1].Version, libs[1].Path)
	return g
}

// alloc returns n bytes of device memory, freed at the end of the test.
func (g *gpu) alloc(n int) hal.Ptr {
	g.t.Helper()
	var p uintptr
	g.Do(func() error { g.check("cuMemAlloc_v2", g.d.memAlloc(&p, uint64(n))); return nil })
	g.t.Cleanup(func() { g.Do(func() error { g.d.memFree(p); return nil }) })
	return hal.Ptr(p)
}

// upload copies b to a new device buffer.
func (g *gpu) upload(b []byte) hal.Ptr {
	g.t.Helper()
	p := g.alloc(len(b))
	g.Do(func() error {
		g.check("cuMemcpyHtoD_v2", g.d.memcpyHtoD(uintptr(p), unsafe.Pointer(&b[0]), uint64(len(b))))
		return nil
	})
	return p
}

// download waits for the stream and copies n bytes from p.
func (g *gpu) download(p hal.Ptr, n int) []byte {
	g.t.Helper()
	b := make([]byte, n)
	g.Do(func() error {
		g.check("cuCtxSynchronize", g.d.ctxSync())
		g.check("cuMemcpyDtoH_v2", g.d.memcpyDtoH(unsafe.Pointer(&b[0]), uintptr(p), uint64(n)))
		return nil
	})
	return b
}

// stream returns the test stream as a hal.Stream.
func (g *gpu) halStream() hal.Stream { return fakeStream{h: g.stream} }

// newStream makes another stream, destroyed at the end of the test.
func (g *gpu) newStream() hal.Stream {
	var s uintptr
	g.Do(func() error { g.check("cuStreamCreate", g.d.streamCreate(&s, 1)); return nil })
	g.t.Cleanup(func() { g.Do(func() error { g.d.streamDestroy(s); return nil }) })
	return fakeStream{h: s}
}

func (g *gpu) handle(math hal.MathMode) hal.BlasHandle {
	g.t.Helper()
	h, err := g.lib.NewHandle(g, g.major, g.minor)
	if err != nil {
		g.t.Fatalf("NewHandle: %v", err)
	}
	g.t.Cleanup(func() {
		if err := h.Destroy(); err != nil {
			g.t.Errorf("Destroy: %v", err)
		}
	})
	if err := h.SetStream(g.halStream()); err != nil {
		g.t.Fatal(err)
	}
	if err := h.SetMathMode(math); err != nil {
		g.t.Fatal(err)
	}
	return h
}

// --- element encoding (complex types are interleaved real, imag) ---

func scalars(dt hal.DType) int {
	if dt == hal.C64 || dt == hal.C128 {
		return 2
	}
	return 1
}

func encode(dt hal.DType, v []float64) []byte {
	var b bytes.Buffer
	for _, x := range v {
		switch dt {
		case hal.F32, hal.C64:
			binary.Write(&b, binary.LittleEndian, float32(x))
		case hal.F64, hal.C128:
			binary.Write(&b, binary.LittleEndian, x)
		case hal.F16:
			binary.Write(&b, binary.LittleEndian, float16.Fromfloat32(float32(x)).Bits())
		case hal.BF16:
			u := math.Float32bits(float32(x))
			u += 0x7fff + (u>>16)&1 // round to nearest even
			binary.Write(&b, binary.LittleEndian, uint16(u>>16))
		}
	}
	return b.Bytes()
}

func decode(dt hal.DType, b []byte) []float64 {
	var out []float64
	r := bytes.NewReader(b)
	for r.Len() > 0 {
		switch dt {
		case hal.F32, hal.C64:
			var x float32
			binary.Read(r, binary.LittleEndian, &x)
			out = append(out, float64(x))
		case hal.F64, hal.C128:
			var x float64
			binary.Read(r, binary.LittleEndian, &x)
			out = append(out, x)
		case hal.F16:
			var u uint16
			binary.Read(r, binary.LittleEndian, &u)
			out = append(out, float64(float16.Frombits(u).Float32()))
		case hal.BF16:
			var u uint16
			binary.Read(r, binary.LittleEndian, &u)
			out = append(out, float64(math.Float32frombits(uint32(u)<<16)))
		}
	}
	return out
}

// randomMatrix returns n random values in [-1, 1) exactly representable in dt.
func randomMatrix(rng *rand.Rand, dt hal.DType, n int) []float64 {
	v := make([]float64, n*scalars(dt))
	for i := range v {
		v[i] = 2*rng.Float64() - 1
	}
	return decode(dt, encode(dt, v))
}

// refGemm is a float64 column-major C = alpha*op(A)*op(B) + beta*C (real).
func refGemm(ta, tb hal.Op, m, n, k int, alpha float64, a []float64, lda int, b []float64, ldb int, beta float64, c []float64, ldc int) []float64 {
	out := append([]float64(nil), c...)
	for j := 0; j < n; j++ {
		for i := 0; i < m; i++ {
			var s float64
			for p := 0; p < k; p++ {
				ai, bi := i+p*lda, p+j*ldb
				if ta == hal.Trans {
					ai = p + i*lda
				}
				if tb == hal.Trans {
					bi = j + p*ldb
				}
				av, bv := a[ai], b[bi]
				s += av * bv
			}
			out[i+j*ldc] = alpha*s + beta*c[i+j*ldc]
		}
	}
	return out
}

// relErr is the relative Frobenius error of got against want over the m×n
// matrix with leading dimension ld (in elements of w scalars each).
func relErr(got, want []float64, m, n, ld, w int) float64 {
	var num, den float64
	for j := 0; j < n; j++ {
		for i := 0; i < m*w; i++ {
			d := got[j*ld*w+i] - want[j*ld*w+i]
			num += d * d
			den += want[j*ld*w+i] * want[j*ld*w+i]
		}
	}
	return math.Sqrt(num / den)
}

// storedCols is the column count of the stored matrix whose op is rows×cols.
func storedCols(o hal.Op, rows, cols int) int {
	if o == hal.Trans {
		return rows
	}
	return cols
}

// gemmCase is one GEMM problem with host data and device buffers.
type gemmCase struct {
	d       hal.GemmDesc
	a, b, c []float64 // host values (C before the GEMM)
	want    []float64
}

func newGemmCase(g *gpu, rng *rand.Rand, ab, ct hal.DType, ta, tb hal.Op, m, n, k int) *gemmCase {
	lda, ldb, ldc := m+3, k+1, m+2
	if ta == hal.Trans {
		lda = k + 3
	}
	if tb == hal.Trans {
		ldb = n + 1
	}
	gc := &gemmCase{
		a: randomMatrix(rng, ab, lda*storedCols(ta, m, k)),
		b: randomMatrix(rng, ab, ldb*storedCols(tb, k, n)),
		c: randomMatrix(rng, ct, ldc*n),
	}
	gc.d = hal.GemmDesc{TransA: ta, TransB: tb, M: m, N: n, K: k, Alpha: 1.25, Beta: -0.5,
		A: g.upload(encode(ab, gc.a)), LDA: lda, B: g.upload(encode(ab, gc.b)), LDB: ldb,
		C: g.upload(encode(ct, gc.c)), LDC: ldc, AB: ab, CType: ct}
	gc.want = refGemm(ta, tb, m, n, k, gc.d.Alpha, gc.a, lda, gc.b, ldb, gc.d.Beta, gc.c, ldc)
	return gc
}

// err downloads C and returns its relative error.
func (gc *gemmCase) err(g *gpu) float64 {
	got := decode(gc.d.CType, g.download(gc.d.C, len(gc.c)*gc.d.CType.Size()))
	return relErr(got, gc.want, gc.d.M, gc.d.N, gc.d.LDC, 1)
}

func tolFor(ab, c hal.DType) float64 {
	switch {
	case ab == hal.F64:
		return 1e-12
	case ab == hal.F32:
		return 1e-5
	case c == hal.F32: // 16-bit inputs, products exact in f32 accumulation
		return 1e-4
	}
	return 2e-2
}

var typePairs = []struct{ ab, c hal.DType }{
	{hal.F32, hal.F32}, {hal.F64, hal.F64}, {hal.BF16, hal.BF16}, {hal.BF16, hal.F32}, {hal.F16, hal.F16}, {hal.F16, hal.F32},
}

var transPairs = []struct{ a, b hal.Op }{{hal.NoTrans, hal.NoTrans}, {hal.Trans, hal.NoTrans}, {hal.NoTrans, hal.Trans}, {hal.Trans, hal.Trans}}

func TestGPUGemm(t *testing.T) {
	g := newGPU(t)
	h := g.handle(hal.MathDefault)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tp := range typePairs {
		for _, tr := range transPairs {
			t.Run(fmt.Sprintf("%v-%v-%d%d", tp.ab, tp.c, tr.a, tr.b), func(t *testing.T) {
				gc := newGemmCase(g, rng, tp.ab, tp.c, tr.a, tr.b, 67, 45, 131)
				if err := h.Gemm(gc.d); err != nil {
					t.Fatal(err)
				}
				if e, tol := gc.err(g), tolFor(tp.ab, tp.c); e > tol {
					t.Fatalf("relative error %.3g > %.3g", e, tol)
				}
			})
		}
	}
}

func TestGPUStreamsAndVersion(t *testing.T) {
	g := newGPU(t)
	h := g.handle(hal.MathDefault)
	hh := h.(*handle)
	s2 := g.newStream()
	rng := rand.New(rand.NewPCG(3, 4))
	for i, s := range []hal.Stream{s2, g.halStream(), s2} {
		if err := h.SetStream(s); err != nil {
			t.Fatal(err)
		}
		var got uintptr
		g.Do(func() error { return g.lib.st.b.statusError("cublasGetStream_v2", g.lib.st.b.getStream(hh.h, &got)) })
		if got != s.(hal.RawStream).Handle() {
			t.Fatalf("switch %d: cublasGetStream_v2 = %#x; want %#x", i, got, s.(hal.RawStream).Handle())
		}
		ws := g.alloc(4 << 20)
		if err := h.SetWorkspace(ws, 4<<20); err != nil {
			t.Fatal(err)
		}
		gc := newGemmCase(g, rng, hal.F32, hal.F32, hal.NoTrans, hal.NoTrans, 64, 64, 64)
		if err := h.Gemm(gc.d); err != nil {
			t.Fatal(err)
		}
		if e := gc.err(g); e > 1e-5 {
			t.Fatalf("switch %d: relative error %.3g", i, e)
		}
	}
	var v int32
	g.Do(func() error { return g.lib.st.b.statusError("cublasGetVersion_v2", g.lib.st.b.getVersion(hh.h, &v)) })
	if got, want := g.lib.Libraries()[0].Version, formatVersion(int(v)); got != want {
		t.Errorf("Libraries version %q; cublasGetVersion_v2 on a handle says %q", got, want)
	}
	if err := h.SetStream(plainStream{}); err == nil {
		t.Error("SetStream accepted a non-CUDA stream")
	}
}

func TestGPUGemmStridedBatched(t *testing.T) {
	g := newGPU(t)
	h := g.handle(hal.MathDefault)
	rng := rand.New(rand.NewPCG(5, 6))
	for _, tp := range typePairs {
		t.Run(fmt.Sprintf("%v-%v", tp.ab, tp.c), func(t *testing.T) {
			const m, n, k, count = 33, 20, 48, 3
			ta, tb := hal.Trans, hal.NoTrans
			lda, ldb, ldc := k+1, k+2, m+3
			sa, sb, sc := lda*m+5, ldb*n+7, ldc*n+1
			a := randomMatrix(rng, tp.ab, sa*count)
			b := randomMatrix(rng, tp.ab, sb*count)
			c := randomMatrix(rng, tp.c, sc*count)
			d := hal.GemmDesc{TransA: ta, TransB: tb, M: m, N: n, K: k, Alpha: 0.75, Beta: 0.5,
				A: g.upload(encode(tp.ab, a)), LDA: lda, B: g.upload(encode(tp.ab, b)), LDB: ldb,
				C: g.upload(encode(tp.c, c)), LDC: ldc, AB: tp.ab, CType: tp.c}
			if err := h.GemmStridedBatched(d, hal.StridedBatch{Count: count, StrideA: int64(sa), StrideB: int64(sb), StrideC: int64(sc)}); err != nil {
				t.Fatal(err)
			}
			got := decode(tp.c, g.download(d.C, len(c)*tp.c.Size()))
			for i := 0; i < count; i++ {
				want := refGemm(ta, tb, m, n, k, d.Alpha, a[i*sa:], lda, b[i*sb:], ldb, d.Beta, c[i*sc:(i+1)*sc], ldc)
				if e, tol := relErr(got[i*sc:], want, m, n, ldc, 1), tolFor(tp.ab, tp.c); e > tol {
					t.Fatalf("batch %d: relative error %.3g > %.3g", i, e, tol)
				}
			}
		})
	}
}

// TestGPUGemmGrouped runs MoE-like grouped GEMMs through the native grouped
// call and the GemmEx loop, checks both against the reference, and compares
// them bitwise.
func TestGPUGemmGrouped(t *testing.T) {
	g := newGPU(t)
	for _, tc := range []struct {
		name  string
		ab, c hal.DType
		math  hal.MathMode
	}{
		{"bf16", hal.BF16, hal.BF16, hal.MathDefault},
		{"f16", hal.F16, hal.F16, hal.MathDefault},
		{"f32", hal.F32, hal.F32, hal.MathDefault},
		{"f32-tf32", hal.F32, hal.F32, hal.MathTF32},
		{"f64", hal.F64, hal.F64, hal.MathDefault},
		{"bf16-f32 (loop only)", hal.BF16, hal.F32, hal.MathDefault},
	} {
		t.Run(tc.name, func(t *testing.T) {
			native := g.handle(tc.math)
			loop := g.handle(tc.math)
			loop.(*handle).native = false
			t.Logf("GroupedNative = %v", native.GroupedNative())
			rng := rand.New(rand.NewPCG(7, 8))
			ms := []int{64, 64, 17, 128, 128, 128, 1, 40}
			const n, k = 96, 80
			var cases []*gemmCase
			var dsN, dsL []hal.GemmDesc
			for _, m := range ms {
				gc := newGemmCase(g, rng, tc.ab, tc.c, hal.Trans, hal.NoTrans, m, n, k)
				gc.d.Alpha, gc.d.Beta = 1, 0.5
				gc.want = refGemm(gc.d.TransA, gc.d.TransB, m, n, k, 1, gc.a, gc.d.LDA, gc.b, gc.d.LDB, 0.5, gc.c, gc.d.LDC)
				cases = append(cases, gc)
				dsN = append(dsN, gc.d)
				dl := gc.d
				dl.C = g.upload(encode(tc.c, gc.c))
				dsL = append(dsL, dl)
			}
			// Run twice more than the ring has slots, so that slots are reused.
			for rep := 0; rep < 2*scratchSlots+1; rep++ {
				if rep > 0 { // restore C
					for i, gc := range cases {
						b := encode(tc.c, gc.c)
						g.Do(func() error {
							g.check("cuCtxSynchronize", g.d.ctxSync())
							g.check("cuMemcpyHtoD_v2", g.d.memcpyHtoD(uintptr(dsN[i].C), unsafe.Pointer(&b[0]), uint64(len(b))))
							return nil
						})
					}
				}
				if err := native.GemmGrouped(dsN); err != nil {
					t.Fatal(err)
				}
			}
			if err := loop.GemmGrouped(dsL); err != nil {
				t.Fatal(err)
			}
			tol := tolFor(tc.ab, tc.c)
			if tc.math == hal.MathTF32 {
				tol = 1e-2
			}
			// 16-bit types: the grouped kernels and GemmEx agree bitwise on
			// cuBLAS 13.1 (H200). f32/f64: they pick different kernels, so
			// results agree only to rounding; check that against tol.
			bitwise := tc.ab == hal.BF16 || tc.ab == hal.F16
			for i, gc := range cases {
				size := len(gc.c) * tc.c.Size()
				bn, bl := g.download(dsN[i].C, size), g.download(dsL[i].C, size)
				vn, vl := decode(tc.c, bn), decode(tc.c, bl)
				if e := relErr(vn, gc.want, gc.d.M, n, gc.d.LDC, 1); e > tol {
					t.Errorf("desc %d (m=%d) grouped: relative error %.3g > %.3g", i, gc.d.M, e, tol)
				}
				if e := relErr(vl, gc.want, gc.d.M, n, gc.d.LDC, 1); e > tol {
					t.Errorf("desc %d (m=%d) loop: relative error %.3g > %.3g", i, gc.d.M, e, tol)
				}
				if bytes.Equal(bn, bl) {
					continue
				}
				d := relErr(vn, vl, gc.d.M, n, gc.d.LDC, 1)
				if bitwise {
					t.Errorf("desc %d (m=%d): native and loop differ bitwise (relative %.3g)", i, gc.d.M, d)
				} else {
					t.Logf("desc %d (m=%d): native and loop differ by relative %.3g", i, gc.d.M, d)
				}
			}
		})
	}
}

// refGeam is a float64 column-major C = alpha*op(A) + beta*op(B) with w
// scalars per element (w = 2: complex, interleaved).
func refGeam(ta, tb hal.Op, m, n int, alpha, beta complex128, a []float64, lda int, b []float64, ldb int, c []float64, ldc, w int) []float64 {
	out := append([]float64(nil), c...)
	at := func(x []float64, o hal.Op, ld, i, j int) complex128 {
		idx := i + j*ld
		if o == hal.Trans {
			idx = j + i*ld
		}
		if w == 1 {
			return complex(x[idx], 0)
		}
		return complex(x[2*idx], x[2*idx+1])
	}
	for j := 0; j < n; j++ {
		for i := 0; i < m; i++ {
			v := alpha*at(a, ta, lda, i, j) + beta*at(b, tb, ldb, i, j)
			if w == 1 {
				out[i+j*ldc] = real(v)
			} else {
				out[2*(i+j*ldc)], out[2*(i+j*ldc)+1] = real(v), imag(v)
			}
		}
	}
	return out
}

func TestGPUGeam(t *testing.T) {
	g := newGPU(t)
	h := g.handle(hal.MathDefault)
	rng := rand.New(rand.NewPCG(9, 10))
	for _, dt := range []hal.DType{hal.F32, hal.F64, hal.C64, hal.C128} {
		t.Run(dt.String(), func(t *testing.T) {
			const m, n = 37, 29
			ta, tb := hal.NoTrans, hal.Trans
			lda, ldb, ldc := m+1, n+2, m+3
			w := scalars(dt)
			a := randomMatrix(rng, dt, lda*n)
			b := randomMatrix(rng, dt, ldb*m)
			c := randomMatrix(rng, dt, ldc*n)
			d := hal.GeamDesc{TransA: ta, TransB: tb, M: m, N: n, Alpha: complex(1.5, -0.25), Beta: complex(-0.75, 0.5),
				A: g.upload(encode(dt, a)), LDA: lda, B: g.upload(encode(dt, b)), LDB: ldb, C: g.upload(encode(dt, c)), LDC: ldc, Type: dt}
			alpha, beta := d.Alpha, d.Beta
			if w == 1 {
				alpha, beta = complex(real(alpha), 0), complex(real(beta), 0)
			}
			want := refGeam(ta, tb, m, n, alpha, beta, a, lda, b, ldb, c, ldc, w)
			if err := h.Geam(d); err != nil {
				t.Fatal(err)
			}
			got := decode(dt, g.download(d.C, len(c)*dt.Size()/w))
			tol := 1e-6
			if dt == hal.F64 || dt == hal.C128 {
				tol = 1e-14
			}
			if e := relErr(got, want, m, n, ldc, w); e > tol {
				t.Fatalf("relative error %.3g > %.3g", e, tol)
			}
		})
	}
}

func TestGPULtMatmul(t *testing.T) {
	g := newGPU(t)
	lt, err := g.lib.NewLtHandle(g)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := lt.Destroy(); err != nil {
			t.Error(err)
		}
	}()
	const wsSize = 32 << 20
	ws := g.alloc(wsSize)
	rng := rand.New(rand.NewPCG(11, 12))
	for _, tp := range []struct{ ab, c hal.DType }{{hal.BF16, hal.BF16}, {hal.BF16, hal.F32}, {hal.F16, hal.F16}, {hal.F32, hal.F32}} {
		for _, tr := range transPairs[:2] {
			t.Run(fmt.Sprintf("%v-%v-%d%d", tp.ab, tp.c, tr.a, tr.b), func(t *testing.T) {
				for rep := 0; rep < 2; rep++ { // second run uses the cached plan
					gc := newGemmCase(g, rng, tp.ab, tp.c, tr.a, tr.b, 128, 72, 256)
					if err := lt.Matmul(g.halStream(), gc.d, ws, wsSize); err != nil {
						t.Fatal(err)
					}
					if e, tol := gc.err(g), tolFor(tp.ab, tp.c); e > tol {
						t.Fatalf("rep %d: relative error %.3g > %.3g", rep, e, tol)
					}
				}
			})
		}
	}
	if n := len(lt.(*ltHandle).plans); n != 8 {
		t.Errorf("%d cached plans; want 8", n)
	}
}

// TestGPUTF32 shows that f32 GEMMs keep f32 accuracy unless MathTF32 is set,
// and that MathTF32 really uses TF32 (larger error) on compute 8.0+.
func TestGPUTF32(t *testing.T) {
	g := newGPU(t)
	h := g.handle(hal.MathDefault)
	rng := rand.New(rand.NewPCG(13, 14))
	run := func() float64 {
		gc := newGemmCase(g, rng, hal.F32, hal.F32, hal.NoTrans, hal.NoTrans, 256, 256, 512)
		if err := h.Gemm(gc.d); err != nil {
			t.Fatal(err)
		}
		return gc.err(g)
	}
	off := run()
	if err := h.SetMathMode(hal.MathTF32); err != nil {
		t.Fatal(err)
	}
	on := run()
	if err := h.SetMathMode(hal.MathTensorOp); err != nil {
		t.Fatal(err)
	}
	offAgain := run()
	t.Logf("f32 relative error: default %.3g, TF32 %.3g, tensor-op (default) %.3g", off, on, offAgain)
	if off > 1e-5 || offAgain > 1e-5 {
		t.Errorf("TF32 off: error %.3g / %.3g > 1e-5", off, offAgain)
	}
	if g.major >= 8 && (on <= 1e-5 || on > 1e-2) {
		t.Errorf("TF32 on: error %.3g; want TF32-sized (1e-5, 1e-2]", on)
	}
}

// TestGPUConcurrentHandles runs one handle per goroutine, each switching
// between two streams of its own and mixing Gemm and native GemmGrouped, and
// checks every result.
func TestGPUConcurrentHandles(t *testing.T) {
	g := newGPU(t)
	const workers, iters = 4, 12
	type job struct {
		h       hal.BlasHandle
		streams [2]hal.Stream
		cases   []*gemmCase
	}
	rng := rand.New(rand.NewPCG(15, 16))
	jobs := make([]job, workers)
	for w := range jobs {
		jobs[w].h = g.handle(hal.MathDefault)
		jobs[w].streams = [2]hal.Stream{g.newStream(), g.newStream()}
		for i := 0; i < iters; i++ {
			jobs[w].cases = append(jobs[w].cases, newGemmCase(g, rng, hal.BF16, hal.BF16, hal.Trans, hal.NoTrans, 64+16*(i%3), 32, 128))
		}
	}
	errs := make(chan error, workers)
	for w := range jobs {
		go func(j job) {
			for i, gc := range j.cases {
				if err := j.h.SetStream(j.streams[i%2]); err != nil {
					errs <- err
					return
				}
				var err error
				if i%3 == 0 {
					err = j.h.Gemm(gc.d)
				} else {
					err = j.h.GemmGrouped([]hal.GemmDesc{gc.d})
				}
				if err != nil {
					errs <- fmt.Errorf("iteration %d: %w", i, err)
					return
				}
			}
			errs <- nil
		}(jobs[w])
	}
	for range jobs {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for w, j := range jobs {
		for i, gc := range j.cases {
			if e := gc.err(g); e > 2e-2 {
				t.Errorf("worker %d iteration %d: relative error %.3g", w, i, e)
			}
		}
	}
}
