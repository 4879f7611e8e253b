package cublas

import (
	"encoding/binary"
	"fmt"
	"testing"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// This file holds a fake cuBLAS/cuBLASLt/driver function table that records
// what the package passes to the library, so that argument marshalling can be
// tested without a GPU.

// directRunner runs fn directly and counts calls.
type directRunner struct{ calls int }

func (r *directRunner) Do(fn func() error) error { r.calls++; return fn() }

// fakeStream is a hal.Stream that is a CUDA stream (hal.RawStream). Only
// Handle is implemented; the embedded nil interface makes it a hal.Stream.
type fakeStream struct {
	hal.Stream
	h uintptr
}

func (s fakeStream) Handle() uintptr { return s.h }

// plainStream is a hal.Stream that is not a CUDA stream.
type plainStream struct{ hal.Stream }

// gemmCall records one cublasGemmEx.
type gemmCall struct {
	h                uintptr
	ta, tb, m, n, k  int32
	alpha, beta      []byte // 16 bytes read from the host pointers during the call
	a, b, c          uintptr
	at, bt, ct       int32
	lda, ldb, ldc    int32
	compute, algo    int32
	strideA, strideB int64
	strideC          int64
	batch            int32
}

// groupedCall records one cublasGemmGroupedBatchedEx, with the device pointer
// arrays resolved through the fake device memory.
type groupedCall struct {
	transa, transb, m, n, k, lda, ldb, ldc, size []int32
	alpha, beta                                  []float64 // widened
	aPtrs, bPtrs, cPtrs                          []uintptr
	at, bt, ct, compute                          int32
	stream                                       uintptr
}

// fake is the recording library.
type fake struct {
	st *state

	stream    uintptr // last SetStream
	workspace [2]uint64
	mathMode  int32
	ptrMode   int32
	failWith  int32 // status every BLAS compute call returns
	gemms     []gemmCall
	geams     []string
	grouped   []groupedCall
	created   int
	// misaligned counts scalar pointers not 16-byte aligned (cuBLAS needs
	// that for cuDoubleComplex).
	misaligned int
	destroyed  int

	// driver
	hostBufs   map[uintptr][]byte // pinned host allocations
	devBufs    map[uintptr][]byte // device allocations (fake addresses)
	nextDev    uintptr
	copies     []uintptr // stream of every HtoD copy
	eventSyncs int
	records    int
	frees      int

	// Lt
	ltDescs, ltLayouts, ltHeur, ltMatmuls, ltDescFree, ltLayoutFree int
	ltTrans                                                         []int32
	ltLayoutDims                                                    [][3]int64
	ltWS                                                            []uint64
	ltStreams                                                       []uintptr
	ltNoAlgo                                                        bool
}

func (f *fake) checkAlign(ps ...unsafe.Pointer) {
	for _, p := range ps {
		if uintptr(p)%16 != 0 {
			f.misaligned++
		}
	}
}

func read16(p unsafe.Pointer) []byte {
	return append([]byte(nil), unsafe.Slice((*byte)(p), 16)...)
}

// devSlice returns the fake device bytes at addr (inside any allocation).
func (f *fake) devSlice(addr uintptr, n int) []byte {
	for base, b := range f.devBufs {
		if addr >= base && addr+uintptr(n) <= base+uintptr(len(b)) {
			return b[addr-base : addr-base+uintptr(n)]
		}
	}
	panic(fmt.Sprintf("fake: device address %#x (+%d) not allocated", addr, n))
}

func (f *fake) devPtrs(addr uintptr, n int) []uintptr {
	b := f.devSlice(addr, n*8)
	out := make([]uintptr, n)
	for i := range out {
		out[i] = uintptr(binary.LittleEndian.Uint64(b[8*i:]))
	}
	return out
}

func widen(p unsafe.Pointer, n int, compute int32) []float64 {
	out := make([]float64, n)
	for i := range out {
		if compute == computeF64 {
			out[i] = unsafe.Slice((*float64)(p), n)[i]
		} else {
			out[i] = float64(unsafe.Slice((*float32)(p), n)[i])
		}
	}
	return out
}

// newFake returns a state whose tables call into a new fake.
func newFake(grouped bool) *fake {
	f := &fake{hostBufs: map[uintptr][]byte{}, devBufs: map[uintptr][]byte{}, nextDev: 0x10000}
	st := &state{drvOK: true}
	f.st = st
	b := &st.b
	b.create = func(h *uintptr) int32 { f.created++; *h = 0xb1a5; return 0 }
	b.destroy = func(h uintptr) int32 { f.destroyed++; return 0 }
	b.setStream = func(h, s uintptr) int32 { f.stream = s; return 0 }
	b.getStream = func(h uintptr, s *uintptr) int32 { *s = f.stream; return 0 }
	b.setWorkspace = func(h, ws uintptr, n uint64) int32 { f.workspace = [2]uint64{uint64(ws), n}; return 0 }
	b.setMathMode = func(h uintptr, m int32) int32 { f.mathMode = m; return 0 }
	b.setPointerMod = func(h uintptr, m int32) int32 { f.ptrMode = m; return 0 }
	b.getVersion = func(h uintptr, v *int32) int32 { *v = 130100; return 0 }
	b.gemmEx = func(h uintptr, ta, tb, m, n, k int32, alpha unsafe.Pointer, a uintptr, at, lda int32, bp uintptr, bt, ldb int32, beta unsafe.Pointer, c uintptr, ct, ldc int32, compute, algo int32) int32 {
		f.checkAlign(alpha, beta)
		f.gemms = append(f.gemms, gemmCall{h: h, ta: ta, tb: tb, m: m, n: n, k: k, alpha: read16(alpha), beta: read16(beta),
			a: a, b: bp, c: c, at: at, bt: bt, ct: ct, lda: lda, ldb: ldb, ldc: ldc, compute: compute, algo: algo})
		return f.failWith
	}
	b.gemmStridedBatchedEx = func(h uintptr, ta, tb, m, n, k int32, alpha unsafe.Pointer, a uintptr, at, lda int32, sa int64, bp uintptr, bt, ldb int32, sb int64, beta unsafe.Pointer, c uintptr, ct, ldc int32, sc int64, batch, compute, algo int32) int32 {
		f.checkAlign(alpha, beta)
		f.gemms = append(f.gemms, gemmCall{h: h, ta: ta, tb: tb, m: m, n: n, k: k, alpha: read16(alpha), beta: read16(beta),
			a: a, b: bp, c: c, at: at, bt: bt, ct: ct, lda: lda, ldb: ldb, ldc: ldc, compute: compute, algo: algo,
			strideA: sa, strideB: sb, strideC: sc, batch: batch})
		return f.failWith
	}
	if grouped {
		b.gemmGroupedBatchedEx = func(h uintptr, ta, tb, m, n, k *int32, alpha unsafe.Pointer, a uintptr, at int32, lda *int32, bp uintptr, bt int32, ldb *int32, beta unsafe.Pointer, c uintptr, ct int32, ldc *int32, ng int32, size *int32, compute int32) int32 {
			g := int(ng)
			arr := func(p *int32) []int32 { return append([]int32(nil), unsafe.Slice(p, g)...) }
			call := groupedCall{transa: arr(ta), transb: arr(tb), m: arr(m), n: arr(n), k: arr(k), lda: arr(lda), ldb: arr(ldb), ldc: arr(ldc), size: arr(size),
				alpha: widen(alpha, g, compute), beta: widen(beta, g, compute), at: at, bt: bt, ct: ct, compute: compute, stream: f.stream}
			total := 0
			for _, s := range call.size {
				total += int(s)
			}
			call.aPtrs, call.bPtrs, call.cPtrs = f.devPtrs(a, total), f.devPtrs(bp, total), f.devPtrs(c, total)
			f.grouped = append(f.grouped, call)
			return f.failWith
		}
	}
	geam := func(name string) geamFn {
		return func(h uintptr, ta, tb, m, n int32, alpha unsafe.Pointer, a uintptr, lda int32, beta unsafe.Pointer, bp uintptr, ldb int32, c uintptr, ldc int32) int32 {
			f.checkAlign(alpha, beta)
			f.geams = append(f.geams, name)
			f.gemms = append(f.gemms, gemmCall{ta: ta, tb: tb, m: m, n: n, alpha: read16(alpha), beta: read16(beta), a: a, b: bp, c: c, lda: lda, ldb: ldb, ldc: ldc})
			return f.failWith
		}
	}
	b.sgeam, b.dgeam, b.cgeam, b.zgeam = geam("S"), geam("D"), geam("C"), geam("Z")

	d := &st.d
	d.memAlloc = func(p *uintptr, n uint64) int32 {
		*p = f.nextDev
		f.devBufs[f.nextDev] = make([]byte, n)
		f.nextDev += uintptr(n) + 0x1000
		return 0
	}
	d.memFree = func(p uintptr) int32 { delete(f.devBufs, p); f.frees++; return 0 }
	d.memAllocHost = func(p *unsafe.Pointer, n uint64) int32 {
		b := make([]byte, n)
		*p = unsafe.Pointer(&b[0])
		f.hostBufs[uintptr(*p)] = b
		return 0
	}
	d.memFreeHost = func(p unsafe.Pointer) int32 { delete(f.hostBufs, uintptr(p)); f.frees++; return 0 }
	d.memcpyHtoDAsyn = func(dst uintptr, src unsafe.Pointer, n uint64, s uintptr) int32 {
		copy(f.devSlice(dst, int(n)), unsafe.Slice((*byte)(src), n))
		f.copies = append(f.copies, s)
		return 0
	}
	ev := uintptr(0xe0)
	d.eventCreate = func(e *uintptr, flags uint32) int32 { ev++; *e = ev; return 0 }
	d.eventRecord = func(e, s uintptr) int32 { f.records++; return 0 }
	d.eventSync = func(e uintptr) int32 { f.eventSyncs++; return 0 }
	d.eventDestroy = func(e uintptr) int32 { return 0 }
	d.streamSync = func(s uintptr) int32 { return 0 }

	l := &st.l
	l.create = func(h *uintptr) int32 { *h = 0x17; return 0 }
	l.destroy = func(h uintptr) int32 { return 0 }
	l.getVersion = func() uint64 { return 130100 }
	l.descCreate = func(d *uintptr, compute, scale int32) int32 { f.ltDescs++; *d = uintptr(0xd000 + f.ltDescs); return 0 }
	l.descDestroy = func(d uintptr) int32 { f.ltDescFree++; return 0 }
	l.descSetAttribute = func(d uintptr, attr int32, buf unsafe.Pointer, n uint64) int32 {
		f.ltTrans = append(f.ltTrans, attr, *(*int32)(buf))
		return 0
	}
	l.layoutCreate = func(p *uintptr, typ int32, rows, cols uint64, ld int64) int32 {
		f.ltLayouts++
		*p = uintptr(0xa000 + f.ltLayouts)
		f.ltLayoutDims = append(f.ltLayoutDims, [3]int64{int64(rows), int64(cols), ld})
		return 0
	}
	l.layoutDestroy = func(p uintptr) int32 { f.ltLayoutFree++; return 0 }
	l.prefCreate = func(p *uintptr) int32 { *p = 0xf; return 0 }
	l.prefDestroy = func(p uintptr) int32 { return 0 }
	l.prefSetAttribute = func(p uintptr, attr int32, buf unsafe.Pointer, n uint64) int32 {
		f.ltWS = append(f.ltWS, *(*uint64)(buf))
		return 0
	}
	l.algoGetHeuristic = func(h, desc, a, b, c, d, pref uintptr, req int32, res *ltHeuristicResult, n *int32) int32 {
		f.ltHeur++
		if f.ltNoAlgo {
			*n = 0
			return 0
		}
		res.algo[0] = 42
		*n = 1
		return 0
	}
	l.matmul = func(h, desc uintptr, alpha unsafe.Pointer, a, ad, bp, bd uintptr, beta unsafe.Pointer, c, cd, dd, ddesc uintptr, algo *[8]uint64, ws uintptr, wsn uint64, s uintptr) int32 {
		if algo[0] != 42 {
			panic("fake: matmul without the heuristic's algorithm")
		}
		f.ltMatmuls++
		f.ltStreams = append(f.ltStreams, s)
		return f.failWith
	}
	return f
}

// lib returns a Lib over the fake state (one reference).
func (f *fake) lib() *Lib {
	f.st.refs++
	return &Lib{st: f.st}
}

// newHandle makes a BLAS handle on the fake through Lib.NewHandle.
func (f *fake) newHandle(t testing.TB, major int) *handle {
	t.Helper()
	l := f.lib()
	h, err := l.NewHandle(&directRunner{}, major, 0)
	if err != nil {
		t.Fatalf("NewHandle: %v", err)
	}
	if err := l.Close(); err != nil {
		t.Fatalf("Lib.Close: %v", err)
	}
	return h.(*handle)
}
