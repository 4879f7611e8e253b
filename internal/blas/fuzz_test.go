package blas_test

import (
	"bytes"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// fuzzEnv is one CPU device, stream and Context shared by every fuzz input.
type fuzzEnv struct {
	dev *gpuctx.Device
	s   *gpuctx.Stream
	ctx *gpuctx.Context
}

var (
	fuzzOnce sync.Once
	fuzzE    fuzzEnv
	fuzzErr  error
)

func openFuzzEnv() (*fuzzEnv, error) {
	fuzzOnce.Do(func() {
		rt, err := gpuctx.OpenBackend("cpu")
		if err != nil {
			fuzzErr = err
			return
		}
		if fuzzE.dev, fuzzErr = rt.Device(0); fuzzErr != nil {
			return
		}
		if fuzzE.s, fuzzErr = fuzzE.dev.NewStream(gpuctx.StreamOptions{}); fuzzErr != nil {
			return
		}
		fuzzE.ctx, fuzzErr = fuzzE.dev.NewContext(gpuctx.ContextOptions{Stream: fuzzE.s})
	})
	return &fuzzE, fuzzErr
}

const (
	guard     = 256  // guard bytes on each side of every operand
	maxElems  = 1024 // largest operand buffer, in elements
	guardByte = 0xff // NaN in every float type: reading a guard poisons C
)

// guarded is an operand buffer with guard bytes around it, inside one
// allocation, so that the CPU backend (which checks whole allocations) does not
// mask a read or write just outside the operand.
type guarded struct {
	arena *gpuctx.Buffer
	view  *gpuctx.Buffer
	want  []byte // the arena's contents when unchanged
}

func newGuarded(t *testing.T, d *gpuctx.Device, n int) *guarded {
	t.Helper()
	arena, err := d.Alloc(n + 2*guard)
	if err != nil {
		t.Fatal(err)
	}
	want := bytes.Repeat([]byte{guardByte}, n+2*guard)
	clear(want[guard : guard+n]) // operands hold zeros
	if err := arena.CopyFromHost(want); err != nil {
		t.Fatal(err)
	}
	view, err := arena.Slice(guard, n)
	if err != nil {
		t.Fatal(err)
	}
	return &guarded{arena: arena, view: view, want: want}
}

func (g *guarded) contents(t *testing.T) []byte {
	t.Helper()
	got := make([]byte, g.arena.Size())
	if err := g.arena.CopyToHost(got); err != nil {
		t.Fatal(err)
	}
	return got
}

var gemmTypes = [][2]gpuctx.DType{{gpuctx.F32, gpuctx.F32}, {gpuctx.BF16, gpuctx.F32}, {gpuctx.F16, gpuctx.F16},
	{gpuctx.F64, gpuctx.F64}, {gpuctx.BF16, gpuctx.BF16}, {gpuctx.F32, gpuctx.F64}, {0, gpuctx.F32}}
var geamTypes = []gpuctx.DType{gpuctx.F32, gpuctx.F64, gpuctx.C64, gpuctx.C128, gpuctx.F16}

// FuzzGemmValidate builds random Gemm, GemmStridedBatched, GemmGrouped and Geam
// calls (any shape, leading dimension, stride, count, layout, transpose, dtype
// and buffer size) and checks that validation never panics and that every call
// it accepts stays inside its buffers: the call runs on the CPU backend without
// a fault, no guard byte around any operand changes, the inputs are unchanged,
// and C holds no NaN (the guards are NaN, the operands zero, so a read outside
// A or B shows up in C).
func FuzzGemmValidate(f *testing.F) {
	f.Add(uint8(0), uint8(0), 3, 4, 5, 0, 0, 0, 1, 0, 0, 0, uint16(15), uint16(20), uint16(12))
	f.Add(uint8(1), uint8(0), 3, 4, 5, 0, 0, 0, 3, 17, 23, 13, uint16(49), uint16(66), uint16(38))
	f.Add(uint8(1), uint8(1), 3, 4, 5, 6, 7, 5, 3, 20, 30, 25, uint16(60), uint16(70), uint16(60))
	f.Add(uint8(1), uint8(6), 2, 7, 3, 0, 0, 0, 4, 6, 21, 14, uint16(24), uint16(84), uint16(56))
	f.Add(uint8(2), uint8(3), 4, 2, 3, 0, 0, 0, 2, 0, 0, 0, uint16(12), uint16(6), uint16(8))
	f.Add(uint8(3), uint8(5), 3, 4, 0, 5, 3, 4, 1, 0, 0, 0, uint16(20), uint16(12), uint16(16))
	f.Add(uint8(1), uint8(0), 3, 4, 5, 0, 0, 0, 3, math.MaxInt/2, 0, 12, uint16(100), uint16(100), uint16(100))
	f.Add(uint8(0), uint8(2), 3, 4, 5, math.MaxInt/3, 0, 0, 1, 0, 0, 0, uint16(100), uint16(100), uint16(100))
	f.Add(uint8(1), uint8(0), 0, 4, 5, 0, 0, 0, math.MaxInt, 0, 0, 0, uint16(1), uint16(1), uint16(1))
	f.Add(uint8(1), uint8(0), 2, 2, 2, 0, 0, 0, 3, 4, 4, 3, uint16(12), uint16(12), uint16(64))
	f.Fuzz(func(t *testing.T, op, flags uint8, m, n, k, lda, ldb, ldc, count, sa, sb, sc int, la, lb, lc uint16) {
		e, err := openFuzzEnv()
		if err != nil {
			t.Fatal(err)
		}
		layout := gpuctx.RowMajor
		if flags&1 != 0 {
			layout = gpuctx.ColMajor
		}
		ta, tb := flags&2 != 0, flags&4 != 0
		if flags&0x80 != 0 {
			layout = gpuctx.Layout(int(flags) >> 3) // sometimes an invalid layout
		}
		ab, ct := gemmTypes[int(flags>>3)%len(gemmTypes)][0], gemmTypes[int(flags>>3)%len(gemmTypes)][1]
		gt := geamTypes[int(flags>>3)%len(geamTypes)]
		size := func(elems uint16, t gpuctx.DType) int {
			es := t.Size()
			if es == 0 {
				es = 4
			}
			return int(elems) % (maxElems + 1) * es
		}
		isGeam := op%4 == 3
		ta0, tc0 := ab, ct
		if isGeam {
			ta0, tc0 = gt, gt
		}
		A, B, C := newGuarded(t, e.dev, size(la, ta0)), newGuarded(t, e.dev, size(lb, ta0)), newGuarded(t, e.dev, size(lc, tc0))
		defer func() { _ = A.arena.Free(); _ = B.arena.Free(); _ = C.arena.Free() }()
		g := gpuctx.Gemm{Layout: layout, TransA: ta, TransB: tb, M: m, N: n, K: k, Alpha: 1, Beta: 1,
			A: A.view, B: B.view, C: C.view, LDA: lda, LDB: ldb, LDC: ldc, AB: ab, CType: ct}
		what := fmt.Sprintf("op %d %+v count %d strides %d %d %d", op%4, g, count, sa, sb, sc)
		err = e.ctx.Blas(func(h gpuctx.Blas) error {
			switch op % 4 {
			case 0:
				return h.Gemm(g)
			case 1:
				return h.GemmStridedBatched(g, count, sa, sb, sc)
			case 2:
				g2 := g
				g2.M, g2.N = n, m
				return h.GemmGrouped([]gpuctx.Gemm{g, g2})
			default:
				return h.Geam(gpuctx.Geam{Layout: layout, TransA: ta, TransB: tb, M: m, N: n, Alpha: 1, Beta: 1,
					A: A.view, B: B.view, C: C.view, LDA: lda, LDB: ldb, LDC: ldc, Type: gt})
			}
		})
		if serr := e.s.Synchronize(); serr != nil {
			t.Fatalf("%s: accepted (err %v) but faulted on the device: %v", what, err, serr)
		}
		if err != nil {
			return // rejected: fine, as long as it did not panic
		}
		if got := A.contents(t); !bytes.Equal(got, A.want) {
			t.Fatalf("%s: A or its guards changed", what)
		}
		if got := B.contents(t); !bytes.Equal(got, B.want) {
			t.Fatalf("%s: B or its guards changed", what)
		}
		got := C.contents(t)
		cn := C.view.Size()
		if !bytes.Equal(got[:guard], C.want[:guard]) || !bytes.Equal(got[guard+cn:], C.want[guard+cn:]) {
			t.Fatalf("%s: a guard byte around C changed: written outside C", what)
		}
		// Every operand is zero, so every correct result is zero; a NaN (or
		// anything else) in C came from a read outside A, B or C.
		for i, b := range got[guard : guard+cn] {
			if b != 0 {
				t.Fatalf("%s: C byte %d is %#x, want 0: a guard outside an operand was read", what, i, b)
			}
		}
	})
}
