package cublas

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/gpuctx/gpuctx/internal/dynload"
	"github.com/gpuctx/gpuctx/internal/hal"
)

func TestDataType(t *testing.T) {
	for _, tc := range []struct {
		d    hal.DType
		want int32
		ok   bool
	}{
		{hal.F32, 0, true}, {hal.F64, 1, true}, {hal.F16, 2, true}, {hal.BF16, 14, true},
		{hal.C64, 4, true}, {hal.C128, 5, true}, {hal.I32, 0, false}, {hal.U8, 0, false}, {0, 0, false},
	} {
		t.Run(tc.d.String(), func(t *testing.T) {
			got, err := dataType(tc.d)
			if (err == nil) != tc.ok || got != tc.want {
				t.Fatalf("dataType(%v) = %d, %v; want %d, ok=%v", tc.d, got, err, tc.want, tc.ok)
			}
		})
	}
}

func TestOp(t *testing.T) {
	for _, tc := range []struct {
		o    hal.Op
		want int32
		ok   bool
	}{{hal.NoTrans, 0, true}, {hal.Trans, 1, true}, {2, 0, false}, {-1, 0, false}} {
		got, err := op(tc.o)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("op(%d) = %d, %v; want %d, ok=%v", tc.o, got, err, tc.want, tc.ok)
		}
	}
}

func TestMathModeValue(t *testing.T) {
	for _, tc := range []struct {
		name  string
		m     hal.MathMode
		major int
		mode  int32
		tf32  bool
		ok    bool
	}{
		{"default", hal.MathDefault, 9, 0, false, true},
		{"tensorop", hal.MathTensorOp, 9, 0, false, true},
		{"tf32 hopper", hal.MathTF32, 9, 3, true, true},
		{"tf32 ampere", hal.MathTF32, 8, 3, true, true},
		{"tf32 volta falls back", hal.MathTF32, 7, 0, false, true},
		{"tf32 unknown arch", hal.MathTF32, 0, 3, true, true},
		{"invalid", hal.MathMode(9), 9, 0, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mode, tf32, err := mathModeValue(tc.m, tc.major)
			if (err == nil) != tc.ok || mode != tc.mode || tf32 != tc.tf32 {
				t.Fatalf("mathModeValue(%d, %d) = %d, %v, %v; want %d, %v, ok=%v", tc.m, tc.major, mode, tf32, err, tc.mode, tc.tf32, tc.ok)
			}
		})
	}
}

func TestGemmTypesFor(t *testing.T) {
	for _, tc := range []struct {
		ab, c   hal.DType
		tf32    bool
		want    gemmTypes
		wantErr bool
	}{
		{hal.F32, hal.F32, false, gemmTypes{0, 0, 68, scaleF32}, false},
		{hal.F32, hal.F32, true, gemmTypes{0, 0, 77, scaleF32}, false},
		{hal.F64, hal.F64, false, gemmTypes{1, 1, 70, scaleF64}, false},
		{hal.F64, hal.F64, true, gemmTypes{1, 1, 70, scaleF64}, false},
		{hal.F16, hal.F16, false, gemmTypes{2, 2, 68, scaleF32}, false},
		{hal.F16, hal.F32, true, gemmTypes{2, 0, 68, scaleF32}, false},
		{hal.BF16, hal.BF16, false, gemmTypes{14, 14, 68, scaleF32}, false},
		{hal.BF16, hal.F32, false, gemmTypes{14, 0, 68, scaleF32}, false},
		{hal.C64, hal.C64, false, gemmTypes{4, 4, 68, scaleC32}, false},
		{hal.C64, hal.C64, true, gemmTypes{4, 4, 77, scaleC32}, false},
		{hal.C128, hal.C128, false, gemmTypes{5, 5, 70, scaleC64}, false},
		{hal.F32, hal.F64, false, gemmTypes{}, true},
		{hal.F32, hal.BF16, false, gemmTypes{}, true},
		{hal.BF16, hal.F16, false, gemmTypes{}, true},
		{hal.I32, hal.I32, false, gemmTypes{}, true},
	} {
		t.Run(tc.ab.String()+"-"+tc.c.String(), func(t *testing.T) {
			got, err := gemmTypesFor(tc.ab, tc.c, tc.tf32)
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Fatalf("gemmTypesFor(%v, %v, %v) = %+v, %v; want %+v, err=%v", tc.ab, tc.c, tc.tf32, got, err, tc.want, tc.wantErr)
			}
		})
	}
}

func TestFormatVersion(t *testing.T) {
	for _, tc := range []struct {
		v    int
		want string
	}{{130100, "13.1.0"}, {120902, "12.9.2"}, {120504, "12.5.4"}, {110000, "11.0.0"}, {0, ""}, {-1, ""}} {
		if got := formatVersion(tc.v); got != tc.want {
			t.Errorf("formatVersion(%d) = %q; want %q", tc.v, got, tc.want)
		}
	}
}

func TestStatusError(t *testing.T) {
	named := &blasAPI{
		statusName:   func(s int32) string { return "NAME_FROM_LIB" },
		statusString: func(s int32) string { return "described" },
	}
	unknownLib := &blasAPI{statusName: func(s int32) string { return "<unknown>" }}
	for _, tc := range []struct {
		name string
		api  *blasAPI
		s    int32
		want string
	}{
		{"success", &blasAPI{}, 0, ""},
		{"table", &blasAPI{}, 7, "cublasGemmEx: CUBLAS_STATUS_INVALID_VALUE (7)"},
		{"table not supported", nil, 15, "cublasGemmEx: CUBLAS_STATUS_NOT_SUPPORTED (15)"},
		{"unknown", &blasAPI{}, 99, "cublasGemmEx: CUBLAS_STATUS_UNKNOWN (99)"},
		{"library name and detail", named, 13, "cublasGemmEx: NAME_FROM_LIB (13): described"},
		{"library does not know", unknownLib, 3, "cublasGemmEx: CUBLAS_STATUS_ALLOC_FAILED (3)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.api.statusError("cublasGemmEx", tc.s)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("status 0 gave %v", err)
				}
				return
			}
			var se *StatusError
			if !errors.As(err, &se) || se.Status != int(tc.s) || err.Error() != tc.want {
				t.Fatalf("statusError = %v; want %q", err, tc.want)
			}
		})
	}
}

func TestDriverError(t *testing.T) {
	name := "CUDA_ERROR_OUT_OF_MEMORY\x00"
	d := &drvAPI{errorName: func(r int32, s **byte) int32 { *s = unsafe.StringData(name); return 0 }}
	if err := d.driverError("cuMemAlloc_v2", 0); err != nil {
		t.Fatalf("result 0 gave %v", err)
	}
	if got, want := d.driverError("cuMemAlloc_v2", 2).Error(), "cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2)"; got != want {
		t.Errorf("got %q; want %q", got, want)
	}
	if got, want := (&drvAPI{}).driverError("cuEventRecord", 400).Error(), "cuEventRecord: CUDA_ERROR_UNKNOWN (400)"; got != want {
		t.Errorf("got %q; want %q", got, want)
	}
}

func TestScalarSet(t *testing.T) {
	for _, tc := range []struct {
		k    scaleKind
		v    complex128
		want any
	}{
		{scaleF32, complex(1.5, 9), float32(1.5)},
		{scaleF64, complex(-2.25, 9), float64(-2.25)},
		{scaleC32, complex(1, -2), complex64(complex(1, -2))},
		{scaleC64, complex(3, 4), complex(3, 4)},
	} {
		t.Run(fmt.Sprint(tc.k), func(t *testing.T) {
			s := new(scalar)
			for i := range s {
				s[i] = ^uint64(0)
			}
			s.set(tc.k, tc.v)
			p := s.ptr()
			if uintptr(p)%16 != 0 {
				t.Fatalf("scalar at %p is not 16-byte aligned", p)
			}
			var got any
			var size uintptr
			switch tc.want.(type) {
			case float32:
				got, size = *(*float32)(p), 4
			case float64:
				got, size = *(*float64)(p), 8
			case complex64:
				got, size = *(*complex64)(p), 8
			case complex128:
				got, size = *(*complex128)(p), 16
			}
			if got != tc.want {
				t.Fatalf("stored %v; want %v", got, tc.want)
			}
			for _, b := range unsafe.Slice((*byte)(p), 16)[size:] {
				if b != 0 {
					t.Fatalf("bytes after the value not cleared: % x", unsafe.Slice((*byte)(p), 16))
				}
			}
		})
	}
	// A scalar inside a struct at an 8-byte offset is still aligned.
	var holder struct {
		pad uint64
		s   scalar
	}
	holder.s.set(scaleC64, 1i)
	if uintptr(holder.s.ptr())%16 != 0 || *(*complex128)(holder.s.ptr()) != 1i {
		t.Fatal("misaligned scalar in a struct")
	}
}

func TestI32(t *testing.T) {
	if v, err := i32("f", "M", 123); v != 123 || err != nil {
		t.Errorf("i32(123) = %d, %v", v, err)
	}
	_, err := i32("cublasGemmEx", "M", math.MaxInt32+1)
	if err == nil || !strings.Contains(err.Error(), "cublasGemmEx: M = 2147483648") {
		t.Errorf("i32 overflow error = %v", err)
	}
}

// TestSignatures checks that purego accepts every Go signature in the symbol
// tables (types and argument counts), without calling anything.
func TestSignatures(t *testing.T) {
	var b blasAPI
	var l ltAPI
	var d drvAPI
	var syms []dynload.Symbol
	syms = append(syms, b.symbols()...)
	syms = append(syms, l.symbols()...)
	syms = append(syms, d.symbols()...)
	for _, s := range syms {
		t.Run(s.Name, func(t *testing.T) {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("purego rejects %s %T: %v", s.Name, s.Fn, r)
				}
			}()
			purego.RegisterFunc(s.Fn, 0x1000) // never called
			if reflect.ValueOf(s.Fn).Elem().IsNil() {
				t.Fatalf("%s not bound", s.Name)
			}
		})
	}
	if n := unsafe.Sizeof(ltHeuristicResult{}); n != 96 {
		t.Errorf("ltHeuristicResult is %d bytes; cublasLtMatmulHeuristicResult_t is 96", n)
	}
}

func TestLoadWithoutLibraries(t *testing.T) {
	if !hasNoCUDA() {
		t.Skip("cuBLAS is installed here; the GPU tests cover Load")
	}
	l, err := Load()
	if err == nil {
		l.Close()
		t.Fatal("Load succeeded without libcublas")
	}
	if !errors.Is(err, dynload.ErrNotFound) || !strings.Contains(err.Error(), "libcublas.so.13") {
		t.Fatalf("Load error = %v; want a dynload.ErrNotFound naming libcublas.so.13", err)
	}
}

// hasNoCUDA reports whether libcublas cannot be opened here.
func hasNoCUDA() bool {
	lib, err := dynload.Open(dynload.Spec{Name: "cuBLAS", Sonames: []string{"libcublas.so.13", "libcublas.so.12"}})
	if err != nil {
		return true
	}
	lib.Close()
	return false
}

func TestLibRefCount(t *testing.T) {
	f := newFake(true)
	shared.mu.Lock()
	if shared.st != nil {
		shared.mu.Unlock()
		t.Skip("real libraries loaded by another test")
	}
	f.st.refs = 1
	shared.st = f.st
	shared.mu.Unlock()
	first := &Lib{st: f.st}

	second, err := Load()
	if err != nil || second.st != f.st {
		t.Fatalf("second Load = %v, %v; want the shared state", second, err)
	}
	h, err := second.NewHandle(&directRunner{}, 9, 0)
	if err != nil {
		t.Fatal(err)
	}
	lt, err := second.NewLtHandle(&directRunner{})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ { // double Close is harmless
		if err := first.Close(); err != nil {
			t.Fatal(err)
		}
		if err := second.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if f.st.refs != 2 || shared.st != f.st {
		t.Fatalf("after closing both Libs: refs %d, shared %v; handles must keep the libraries", f.st.refs, shared.st == f.st)
	}
	if _, err := second.NewHandle(&directRunner{}, 9, 0); !errors.Is(err, hal.ErrClosed) {
		t.Errorf("NewHandle after Close = %v; want ErrClosed", err)
	}
	if libs := second.Libraries(); libs != nil {
		t.Errorf("Libraries after Close = %v", libs)
	}
	if err := h.Destroy(); err != nil {
		t.Fatal(err)
	}
	if err := h.Destroy(); err != nil {
		t.Fatalf("second Destroy: %v", err)
	}
	if err := lt.Destroy(); err != nil {
		t.Fatal(err)
	}
	if f.st.refs != 0 || shared.st != nil {
		t.Fatalf("after destroying handles: refs %d, shared still set %v", f.st.refs, shared.st != nil)
	}
	if f.destroyed != 1 {
		t.Errorf("cublasDestroy_v2 called %d times; want 1", f.destroyed)
	}
	if err := h.Gemm(hal.GemmDesc{}); !errors.Is(err, hal.ErrClosed) {
		t.Errorf("Gemm after Destroy = %v; want ErrClosed", err)
	}
	if err := lt.Matmul(fakeStream{h: 1}, hal.GemmDesc{AB: hal.F32, CType: hal.F32}, 0, 0); !errors.Is(err, hal.ErrClosed) {
		t.Errorf("Matmul after Destroy = %v; want ErrClosed", err)
	}
}

func TestLibraries(t *testing.T) {
	f := newFake(true)
	l := f.lib()
	defer l.Close()
	got := l.Libraries()
	want := []hal.Library{{Name: "cublas", Version: "13.1.0"}, {Name: "cublasLt", Version: "13.1.0"}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Libraries = %+v; want %+v", got, want)
	}
	f.st.b.getProperty = func(typ int32, v *int32) int32 { *v = []int32{12, 9, 1}[typ]; return 0 }
	if got := l.Libraries()[0].Version; got != "12.9.1" {
		t.Errorf("version from cublasGetProperty = %q; want 12.9.1", got)
	}
}

func TestNewHandleSetsHostPointerMode(t *testing.T) {
	f := newFake(true)
	f.ptrMode = 99
	h := f.newHandle(t, 9)
	defer h.Destroy()
	if f.ptrMode != pointerModeHost || f.created != 1 {
		t.Errorf("pointer mode %d, created %d", f.ptrMode, f.created)
	}
	if !h.GroupedNative() {
		t.Error("GroupedNative false with the grouped symbol and the driver present")
	}
	f2 := newFake(false)
	h2 := f2.newHandle(t, 9)
	defer h2.Destroy()
	if h2.GroupedNative() {
		t.Error("GroupedNative true without cublasGemmGroupedBatchedEx")
	}
}

func TestSetStreamAndWorkspace(t *testing.T) {
	f := newFake(true)
	h := f.newHandle(t, 9)
	defer h.Destroy()
	for _, tc := range []struct {
		name string
		s    hal.Stream
		ok   bool
	}{{"cuda", fakeStream{h: 0x5}, true}, {"nil", nil, false}, {"not cuda", plainStream{}, false}, {"cuda again", fakeStream{h: 0x6}, true}} {
		t.Run(tc.name, func(t *testing.T) {
			before := f.stream
			err := h.SetStream(tc.s)
			if (err == nil) != tc.ok {
				t.Fatalf("SetStream = %v; ok want %v", err, tc.ok)
			}
			if tc.ok && f.stream != tc.s.(fakeStream).h {
				t.Fatalf("bound stream %#x", f.stream)
			}
			if !tc.ok && f.stream != before {
				t.Fatal("failed SetStream changed the binding")
			}
		})
	}
	if err := h.SetWorkspace(0x9000, 1<<20); err != nil || f.workspace != [2]uint64{0x9000, 1 << 20} {
		t.Errorf("SetWorkspace: %v, %v", err, f.workspace)
	}
	if err := h.SetWorkspace(0x9000, -1); err == nil {
		t.Error("negative workspace size accepted")
	}
}

func f32bits(v float32) []byte {
	var s scalar
	s.set(scaleF32, complex(float64(v), 0))
	return read16(s.ptr())
}

func f64bits(v float64) []byte {
	var s scalar
	s.set(scaleF64, complex(v, 0))
	return read16(s.ptr())
}

func TestGemmMarshalling(t *testing.T) {
	base := hal.GemmDesc{TransA: hal.Trans, TransB: hal.NoTrans, M: 3, N: 5, K: 7, Alpha: 1.5, Beta: -0.5,
		A: 0x100, LDA: 7, B: 0x200, LDB: 7, C: 0x300, LDC: 3}
	for _, tc := range []struct {
		name            string
		ab, c           hal.DType
		math            hal.MathMode
		at, ct, compute int32
		alpha, beta     []byte
	}{
		{"f32", hal.F32, hal.F32, hal.MathDefault, 0, 0, 68, f32bits(1.5), f32bits(-0.5)},
		{"f32 tf32", hal.F32, hal.F32, hal.MathTF32, 0, 0, 77, f32bits(1.5), f32bits(-0.5)},
		{"f32 tensorop", hal.F32, hal.F32, hal.MathTensorOp, 0, 0, 68, f32bits(1.5), f32bits(-0.5)},
		{"f64", hal.F64, hal.F64, hal.MathTF32, 1, 1, 70, f64bits(1.5), f64bits(-0.5)},
		{"bf16", hal.BF16, hal.BF16, hal.MathDefault, 14, 14, 68, f32bits(1.5), f32bits(-0.5)},
		{"bf16 to f32", hal.BF16, hal.F32, hal.MathTF32, 14, 0, 68, f32bits(1.5), f32bits(-0.5)},
		{"f16", hal.F16, hal.F16, hal.MathDefault, 2, 2, 68, f32bits(1.5), f32bits(-0.5)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(true)
			h := f.newHandle(t, 9)
			defer h.Destroy()
			if err := h.SetMathMode(tc.math); err != nil {
				t.Fatal(err)
			}
			d := base
			d.AB, d.CType = tc.ab, tc.c
			if err := h.Gemm(d); err != nil {
				t.Fatal(err)
			}
			want := gemmCall{h: 0xb1a5, ta: 1, tb: 0, m: 3, n: 5, k: 7, alpha: tc.alpha, beta: tc.beta, a: 0x100, b: 0x200, c: 0x300,
				at: tc.at, bt: tc.at, ct: tc.ct, lda: 7, ldb: 7, ldc: 3, compute: tc.compute, algo: -1}
			if len(f.gemms) != 1 || !reflect.DeepEqual(f.gemms[0], want) {
				t.Fatalf("cublasGemmEx got\n%+v\nwant\n%+v", f.gemms, want)
			}
			f.gemms = nil
			if err := h.GemmStridedBatched(d, hal.StridedBatch{Count: 4, StrideA: 21, StrideB: 35, StrideC: 15}); err != nil {
				t.Fatal(err)
			}
			want.strideA, want.strideB, want.strideC, want.batch = 21, 35, 15, 4
			if len(f.gemms) != 1 || !reflect.DeepEqual(f.gemms[0], want) {
				t.Fatalf("cublasGemmStridedBatchedEx got\n%+v\nwant\n%+v", f.gemms, want)
			}
			if f.misaligned != 0 {
				t.Fatalf("%d scalar pointers not 16-byte aligned", f.misaligned)
			}
		})
	}
}

func TestGemmErrors(t *testing.T) {
	f := newFake(true)
	h := f.newHandle(t, 9)
	defer h.Destroy()
	good := hal.GemmDesc{M: 1, N: 1, K: 1, LDA: 1, LDB: 1, LDC: 1, AB: hal.F32, CType: hal.F32}
	for _, tc := range []struct {
		name string
		mod  func(*hal.GemmDesc)
		fail int32
		want string
	}{
		{"bad types", func(d *hal.GemmDesc) { d.CType = hal.F64 }, 0, "not supported"},
		{"bad trans", func(d *hal.GemmDesc) { d.TransB = 5 }, 0, "TransB"},
		{"huge K", func(d *hal.GemmDesc) { d.K = 1 << 40 }, 0, "K = 1099511627776"},
		{"status", func(d *hal.GemmDesc) {}, 7, "cublasGemmEx: CUBLAS_STATUS_INVALID_VALUE (7)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f.failWith = tc.fail
			d := good
			tc.mod(&d)
			err := h.Gemm(d)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Gemm error = %v; want it to contain %q", err, tc.want)
			}
		})
	}
	f.failWith = 0
	if err := h.SetMathMode(7); err == nil {
		t.Error("invalid math mode accepted")
	}
}

func TestGeam(t *testing.T) {
	d := hal.GeamDesc{TransA: hal.NoTrans, TransB: hal.Trans, M: 4, N: 6, Alpha: complex(2, 3), Beta: complex(-1, 0.5),
		A: 0x10, LDA: 4, B: 0x20, LDB: 6, C: 0x30, LDC: 4}
	for _, tc := range []struct {
		dt          hal.DType
		fn          string
		k           scaleKind
		alpha, beta complex128
		ok          bool
	}{
		{hal.F32, "S", scaleF32, 2, -1, true},
		{hal.F64, "D", scaleF64, 2, -1, true},
		{hal.C64, "C", scaleC32, complex(2, 3), complex(-1, 0.5), true},
		{hal.C128, "Z", scaleC64, complex(2, 3), complex(-1, 0.5), true},
		{hal.BF16, "", 0, 0, 0, false},
	} {
		t.Run(tc.dt.String(), func(t *testing.T) {
			f := newFake(true)
			h := f.newHandle(t, 9)
			defer h.Destroy()
			d.Type = tc.dt
			err := h.Geam(d)
			if !tc.ok {
				if err == nil || len(f.geams) != 0 {
					t.Fatalf("Geam(%v) = %v, calls %v; want an error and no call", tc.dt, err, f.geams)
				}
				return
			}
			if err != nil || len(f.geams) != 1 || f.geams[0] != tc.fn {
				t.Fatalf("Geam(%v) = %v, calls %v", tc.dt, err, f.geams)
			}
			var a, b scalar
			a.set(tc.k, tc.alpha)
			b.set(tc.k, tc.beta)
			g := f.gemms[0]
			want := gemmCall{ta: 0, tb: 1, m: 4, n: 6, alpha: read16(a.ptr()), beta: read16(b.ptr()), a: 0x10, b: 0x20, c: 0x30, lda: 4, ldb: 6, ldc: 4}
			if !reflect.DeepEqual(g, want) {
				t.Fatalf("geam args\n%+v\nwant\n%+v", g, want)
			}
			if f.misaligned != 0 {
				t.Fatalf("%d scalar pointers not 16-byte aligned", f.misaligned)
			}
		})
	}
}

func TestGroupDescs(t *testing.T) {
	sh := func(m, n, k int) hal.GemmDesc {
		return hal.GemmDesc{M: m, N: n, K: k, LDA: m, LDB: k, LDC: m, Alpha: 1}
	}
	trans := sh(2, 2, 2)
	trans.TransA = hal.Trans
	beta := sh(2, 2, 2)
	beta.Beta = 1
	for _, tc := range []struct {
		name string
		ds   []hal.GemmDesc
		want []group
	}{
		{"empty", nil, nil},
		{"one", []hal.GemmDesc{sh(2, 2, 2)}, []group{{0, 1}}},
		{"all equal", []hal.GemmDesc{sh(2, 3, 4), sh(2, 3, 4), sh(2, 3, 4)}, []group{{0, 3}}},
		{"all different", []hal.GemmDesc{sh(1, 3, 4), sh(2, 3, 4), sh(3, 3, 4)}, []group{{0, 1}, {1, 1}, {2, 1}}},
		{"runs keep order", []hal.GemmDesc{sh(2, 2, 2), sh(2, 2, 2), sh(5, 2, 2), sh(2, 2, 2)}, []group{{0, 2}, {2, 1}, {3, 1}}},
		{"transpose splits", []hal.GemmDesc{sh(2, 2, 2), trans}, []group{{0, 1}, {1, 1}}},
		{"beta splits", []hal.GemmDesc{sh(2, 2, 2), beta}, []group{{0, 1}, {1, 1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := groupDescs(tc.ds); !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("groupDescs = %v; want %v", got, tc.want)
			}
		})
	}
}

// groupedDescs returns descs with shapes ms (n=8, k=16), A/B/C addresses
// unique per desc.
func groupedDescs(ab, c hal.DType, ms ...int) []hal.GemmDesc {
	ds := make([]hal.GemmDesc, len(ms))
	for i, m := range ms {
		ds[i] = hal.GemmDesc{M: m, N: 8, K: 16, LDA: m, LDB: 16, LDC: m, Alpha: 2, Beta: 0.5,
			A: hal.Ptr(0x1000 * (i + 1)), B: hal.Ptr(0x1000*(i+1) + 0x100), C: hal.Ptr(0x1000*(i+1) + 0x200), AB: ab, CType: c}
	}
	return ds
}

func TestGemmGroupedNativeMarshalling(t *testing.T) {
	f := newFake(true)
	h := f.newHandle(t, 9)
	if err := h.SetStream(fakeStream{h: 0x77}); err != nil {
		t.Fatal(err)
	}
	ds := groupedDescs(hal.BF16, hal.BF16, 64, 64, 32, 64)
	if err := h.GemmGrouped(ds); err != nil {
		t.Fatal(err)
	}
	if len(f.grouped) != 1 || len(f.gemms) != 0 {
		t.Fatalf("native path made %d grouped and %d GemmEx calls", len(f.grouped), len(f.gemms))
	}
	g := f.grouped[0]
	i32s := func(v ...int32) []int32 { return v }
	want := groupedCall{
		transa: i32s(0, 0, 0), transb: i32s(0, 0, 0), m: i32s(64, 32, 64), n: i32s(8, 8, 8), k: i32s(16, 16, 16),
		lda: i32s(64, 32, 64), ldb: i32s(16, 16, 16), ldc: i32s(64, 32, 64), size: i32s(2, 1, 1),
		alpha: []float64{2, 2, 2}, beta: []float64{0.5, 0.5, 0.5},
		at: 14, bt: 14, ct: 14, compute: 68, stream: 0x77,
	}
	for _, d := range ds {
		want.aPtrs = append(want.aPtrs, uintptr(d.A))
		want.bPtrs = append(want.bPtrs, uintptr(d.B))
		want.cPtrs = append(want.cPtrs, uintptr(d.C))
	}
	if !reflect.DeepEqual(g, want) {
		t.Fatalf("grouped call\n%+v\nwant\n%+v", g, want)
	}
	if len(f.copies) != 1 || f.copies[0] != 0x77 || f.records != 1 {
		t.Errorf("pointer arrays: copies on %v, %d event records; want one copy on the bound stream and one record", f.copies, f.records)
	}
	if err := h.Destroy(); err != nil {
		t.Fatal(err)
	}
	if len(f.devBufs) != 0 || len(f.hostBufs) != 0 || f.eventSyncs != 1 {
		t.Errorf("after Destroy: %d device and %d host buffers left, %d event syncs (want 0, 0, 1)", len(f.devBufs), len(f.hostBufs), f.eventSyncs)
	}
}

func TestGemmGroupedF64AndTF32(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ab      hal.DType
		math    hal.MathMode
		compute int32
	}{{"f64", hal.F64, hal.MathDefault, 70}, {"f32", hal.F32, hal.MathDefault, 68}, {"f32 tf32", hal.F32, hal.MathTF32, 77}} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(true)
			h := f.newHandle(t, 9)
			defer h.Destroy()
			if err := h.SetMathMode(tc.math); err != nil {
				t.Fatal(err)
			}
			if err := h.GemmGrouped(groupedDescs(tc.ab, tc.ab, 4, 4)); err != nil {
				t.Fatal(err)
			}
			if len(f.grouped) != 1 || f.grouped[0].compute != tc.compute || !reflect.DeepEqual(f.grouped[0].alpha, []float64{2}) {
				t.Fatalf("grouped calls %+v; want compute %d, alpha [2]", f.grouped, tc.compute)
			}
		})
	}
}

func TestGemmGroupedLoop(t *testing.T) {
	for _, tc := range []struct {
		name    string
		grouped bool // symbol present
		native  bool // handle allowed to use it
		ab, c   hal.DType
		wantNat bool
	}{
		{"native", true, true, hal.F16, hal.F16, true},
		{"forced loop", true, false, hal.F16, hal.F16, false},
		{"no symbol", false, false, hal.F16, hal.F16, false},
		{"mixed types loop", true, true, hal.BF16, hal.F32, false},
		{"complex loop", true, true, hal.C64, hal.C64, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(tc.grouped)
			h := f.newHandle(t, 9)
			defer h.Destroy()
			h.native = tc.native && tc.grouped
			ds := groupedDescs(tc.ab, tc.c, 8, 8, 16)
			if err := h.GemmGrouped(ds); err != nil {
				t.Fatal(err)
			}
			if tc.wantNat {
				if len(f.grouped) != 1 || len(f.gemms) != 0 {
					t.Fatalf("got %d grouped, %d GemmEx; want the native call", len(f.grouped), len(f.gemms))
				}
				return
			}
			if len(f.grouped) != 0 || len(f.gemms) != len(ds) {
				t.Fatalf("got %d grouped, %d GemmEx; want %d GemmEx", len(f.grouped), len(f.gemms), len(ds))
			}
			for i, g := range f.gemms {
				if g.a != uintptr(ds[i].A) || g.c != uintptr(ds[i].C) || int(g.m) != ds[i].M {
					t.Fatalf("GemmEx %d: %+v does not match desc %+v", i, g, ds[i])
				}
			}
		})
	}
}

func TestGemmGroupedErrors(t *testing.T) {
	f := newFake(true)
	h := f.newHandle(t, 9)
	defer h.Destroy()
	if err := h.GemmGrouped(nil); err != nil || len(f.grouped)+len(f.gemms) != 0 {
		t.Fatalf("empty GemmGrouped = %v with calls", err)
	}
	ds := groupedDescs(hal.F32, hal.F32, 2, 2)
	ds[1].AB = hal.F64
	if err := h.GemmGrouped(ds); err == nil || !strings.Contains(err.Error(), "desc 1") {
		t.Fatalf("mixed dtypes: %v", err)
	}
	f.failWith = 15
	err := h.GemmGrouped(groupedDescs(hal.F32, hal.F32, 2, 2))
	if err == nil || !strings.Contains(err.Error(), "cublasGemmGroupedBatchedEx: CUBLAS_STATUS_NOT_SUPPORTED (15)") {
		t.Fatalf("failing grouped call: %v", err)
	}
	if f.records != 1 {
		t.Errorf("event not recorded after a failed call (%d)", f.records)
	}
	h.native = false
	err = h.GemmGrouped(groupedDescs(hal.F32, hal.F32, 2, 2))
	if err == nil || !strings.Contains(err.Error(), "GemmGrouped desc 0: cublasGemmEx") {
		t.Fatalf("failing loop: %v", err)
	}
}

// TestScratchRing checks that a slot is reused only after waiting for its
// event, and that growing waits for every slot in flight.
func TestScratchRing(t *testing.T) {
	f := newFake(true)
	h := f.newHandle(t, 9)
	defer h.Destroy()
	small := groupedDescs(hal.F32, hal.F32, 2, 2)
	for i := 0; i < scratchSlots; i++ {
		if err := h.GemmGrouped(small); err != nil {
			t.Fatal(err)
		}
	}
	if f.eventSyncs != 0 {
		t.Fatalf("%d waits while the ring had free slots", f.eventSyncs)
	}
	if err := h.GemmGrouped(small); err != nil {
		t.Fatal(err)
	}
	if f.eventSyncs != 1 {
		t.Fatalf("reusing slot 0 waited %d times; want 1", f.eventSyncs)
	}
	slot := h.scr.slotBytes
	big := make([]int, slot) // slot/8 descs * 3 pointers > slot bytes
	for i := range big {
		big[i] = 2
	}
	if err := h.GemmGrouped(groupedDescs(hal.F32, hal.F32, big...)); err != nil {
		t.Fatal(err)
	}
	if h.scr.slotBytes <= slot {
		t.Fatalf("slot did not grow: %d", h.scr.slotBytes)
	}
	if f.eventSyncs != scratchSlots+1 || f.frees != 2 {
		t.Fatalf("growing: %d waits, %d frees; want %d waits (all slots in flight) and 2 frees", f.eventSyncs, f.frees, scratchSlots+1)
	}
	if got := f.grouped[len(f.grouped)-1]; len(got.aPtrs) != len(big) || got.cPtrs[len(big)-1] != uintptr(0x1000*len(big)+0x200) {
		t.Fatalf("pointer arrays after growth are wrong")
	}
}

func TestLtMatmul(t *testing.T) {
	f := newFake(true)
	l := f.lib()
	defer l.Close()
	lh, err := l.NewLtHandle(&directRunner{})
	if err != nil {
		t.Fatal(err)
	}
	d := hal.GemmDesc{TransA: hal.Trans, TransB: hal.NoTrans, M: 32, N: 16, K: 64, Alpha: 1, LDA: 64, LDB: 64, LDC: 32,
		A: 0x100, B: 0x200, C: 0x300, AB: hal.BF16, CType: hal.BF16}
	s := fakeStream{h: 0x55}
	for i := 0; i < 3; i++ {
		if err := lh.Matmul(s, d, 0x9000, 1<<20); err != nil {
			t.Fatal(err)
		}
	}
	if f.ltDescs != 1 || f.ltHeur != 1 || f.ltMatmuls != 3 {
		t.Fatalf("3 matmuls of one shape: %d descs, %d heuristics, %d matmuls; want 1, 1, 3", f.ltDescs, f.ltHeur, f.ltMatmuls)
	}
	if want := []int32{3, 1, 4, 0}; !reflect.DeepEqual(f.ltTrans, want) {
		t.Errorf("desc attributes %v; want TRANSA(3)=T, TRANSB(4)=N", f.ltTrans)
	}
	if want := [][3]int64{{64, 32, 64}, {64, 16, 64}, {32, 16, 32}}; !reflect.DeepEqual(f.ltLayoutDims, want) {
		t.Errorf("layouts %v; want %v (A stored k×m when transposed)", f.ltLayoutDims, want)
	}
	if !reflect.DeepEqual(f.ltWS, []uint64{1 << 20}) || !reflect.DeepEqual(f.ltStreams, []uintptr{0x55, 0x55, 0x55}) {
		t.Errorf("workspace prefs %v, streams %v", f.ltWS, f.ltStreams)
	}
	if err := lh.Matmul(s, d, 0x9000, 1<<21); err != nil { // another workspace size: new plan
		t.Fatal(err)
	}
	if f.ltDescs != 2 {
		t.Errorf("new workspace size reused the plan")
	}
	for _, tc := range []struct {
		name string
		s    hal.Stream
		mod  func(*hal.GemmDesc)
		ws   int
		want string
	}{
		{"f64", s, func(d *hal.GemmDesc) { d.AB, d.CType = hal.F64, hal.F64 }, 0, "not supported"},
		{"f32 to bf16", s, func(d *hal.GemmDesc) { d.AB, d.CType = hal.F32, hal.BF16 }, 0, "not supported"},
		{"plain stream", plainStream{}, func(d *hal.GemmDesc) {}, 0, "not a CUDA stream"},
		{"negative ws", s, func(d *hal.GemmDesc) {}, -1, "workspace"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dd := d
			tc.mod(&dd)
			if err := lh.Matmul(tc.s, dd, 0x9000, tc.ws); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Matmul = %v; want %q", err, tc.want)
			}
		})
	}
	f.ltNoAlgo = true
	d.M = 33
	if err := lh.Matmul(s, d, 0, 0); err == nil || !strings.Contains(err.Error(), "no algorithm") {
		t.Fatalf("no heuristic result: %v", err)
	}
	if err := lh.Destroy(); err != nil {
		t.Fatal(err)
	}
	if f.ltDescFree != f.ltDescs || f.ltLayoutFree != f.ltLayouts {
		t.Errorf("leaked descriptors: created %d/%d, destroyed %d/%d", f.ltDescs, f.ltLayouts, f.ltDescFree, f.ltLayoutFree)
	}
}

func TestLtPlanCacheBounded(t *testing.T) {
	f := newFake(true)
	l := f.lib()
	defer l.Close()
	lh, err := l.NewLtHandle(&directRunner{})
	if err != nil {
		t.Fatal(err)
	}
	defer lh.Destroy()
	d := hal.GemmDesc{M: 1, N: 1, K: 1, Alpha: 1, LDA: 1, LDB: 1, LDC: 1, AB: hal.F32, CType: hal.F32}
	for i := 0; i <= ltMaxPlans; i++ {
		d.N = i + 1
		if err := lh.Matmul(fakeStream{h: 1}, d, 0, 0); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(lh.(*ltHandle).plans); n != 1 {
		t.Errorf("cache holds %d plans after overflow; want 1", n)
	}
	if f.ltDescFree != ltMaxPlans {
		t.Errorf("overflow destroyed %d descriptors; want %d", f.ltDescFree, ltMaxPlans)
	}
}
