// Package cublas binds NVIDIA cuBLAS and cuBLASLt at run time with purego
// (CGO_ENABLED=0) and implements hal.BlasHandle and hal.LtHandle for the CUDA
// backend.
//
// Load opens libcublas and libcublasLt (sonames .so.13, then .so.12) and
// returns a *Lib; handles come from Lib.NewHandle and Lib.NewLtHandle. Every
// library call that needs the CUDA context current runs inside the handle's
// hal.Runner (Runner.Do), so callers never lock OS threads.
//
// Streams: a BLAS handle queues all its work on the stream of its last
// SetStream; an Lt handle on the stream passed to each Matmul. Streams must be
// CUDA backend streams that implement hal.RawStream.
//
// Concurrency: Load, Lib.Close, Lib.Libraries, Lib.NewHandle and
// Lib.NewLtHandle are safe to call from any goroutine. A handle is not safe for
// concurrent use (the root package's Context serialises access); a handle
// guards its own state with a mutex, so concurrent misuse is an ordering bug,
// not a crash.
package cublas

import (
	"fmt"
	"sync"

	"github.com/gpuctx/gpuctx/internal/dynload"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// state is the loaded libraries and their function tables, shared by every Lib
// returned by Load and every handle made from one. refs counts open Libs plus
// live handles; the libraries are unloaded when it reaches zero.
type state struct {
	blasLib, ltLib, drvLib *dynload.Library // nil in unit tests (fake tables)

	b blasAPI
	l ltAPI
	d drvAPI
	// drvOK reports whether the driver calls needed by the native grouped
	// GEMM are bound; drvErr says why not otherwise.
	drvOK  bool
	drvErr error

	refs int // guarded by shared.mu
}

// shared is the process-wide loaded state (reference counted).
var shared struct {
	mu sync.Mutex
	st *state
}

// Lib is one reference to the loaded cuBLAS and cuBLASLt libraries. Each Load
// returns a new *Lib sharing the same loaded libraries; each must be closed once
// (Close is idempotent). Handles keep the libraries loaded until they are
// destroyed, even after every Lib is closed.
type Lib struct {
	mu     sync.Mutex
	st     *state
	closed bool
}

// Load loads libcublas (libcublas.so.13, then .so.12) and libcublasLt
// (libcublasLt.so.13, then .so.12), binds their symbols, and returns a
// reference to them. It also loads libcuda.so.1 for the few driver calls the
// native grouped GEMM uses; if that fails, GemmGrouped falls back to a loop of
// GemmEx calls. Load issues no GPU work and needs no CUDA context. A second
// Load shares the libraries of the first. It is safe to call from any
// goroutine. The error lists every path tried when a library is missing.
func Load() (*Lib, error) {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.st != nil {
		shared.st.refs++
		return &Lib{st: shared.st}, nil
	}
	st, err := open()
	if err != nil {
		return nil, err
	}
	st.refs = 1
	shared.st = st
	return &Lib{st: st}, nil
}

// open loads and binds the libraries.
func open() (*state, error) {
	st := &state{}
	var err error
	st.blasLib, err = dynload.Open(dynload.Spec{
		Name:    "cuBLAS",
		Sonames: []string{"libcublas.so.13", "libcublas.so.12"},
		Pip:     []string{"nvidia/cublas/lib", "nvidia/cu13/lib"},
		Install: "the CUDA toolkit's cuBLAS (or pip install nvidia-cublas)",
	})
	if err != nil {
		return nil, fmt.Errorf("cublas: Load: %w", err)
	}
	if err := st.blasLib.Bind(st.b.symbols()); err != nil {
		st.blasLib.Close()
		return nil, fmt.Errorf("cublas: Load: %w", err)
	}
	st.ltLib, err = dynload.Open(dynload.Spec{
		Name:    "cuBLASLt",
		Sonames: []string{"libcublasLt.so.13", "libcublasLt.so.12"},
		Pip:     []string{"nvidia/cublas/lib", "nvidia/cu13/lib"},
		Install: "the CUDA toolkit's cuBLAS (or pip install nvidia-cublas)",
	})
	if err == nil {
		if err = st.ltLib.Bind(st.l.symbols()); err != nil {
			st.ltLib.Close()
		}
	}
	if err != nil {
		st.blasLib.Close()
		return nil, fmt.Errorf("cublas: Load: %w", err)
	}
	st.drvLib, err = dynload.Open(dynload.Spec{
		Name:    "CUDA driver",
		Sonames: []string{"libcuda.so.1"},
		Install: "the NVIDIA driver",
	})
	if err == nil {
		if err = st.drvLib.Bind(st.d.symbols()); err != nil {
			st.drvLib.Close()
			st.drvLib = nil
		}
	} else {
		st.drvLib = nil
	}
	st.drvOK, st.drvErr = err == nil, err
	return st, nil
}

// acquire adds a reference to st for a new handle.
func (st *state) acquire() {
	shared.mu.Lock()
	st.refs++
	shared.mu.Unlock()
}

// release drops a reference and unloads the libraries at zero.
func (st *state) release() error {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	st.refs--
	if st.refs > 0 {
		return nil
	}
	if shared.st == st {
		shared.st = nil
	}
	var first error
	for _, l := range []*dynload.Library{st.drvLib, st.ltLib, st.blasLib} {
		if l == nil {
			continue
		}
		if err := l.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// Close drops this reference to the libraries; they are unloaded once every Lib
// is closed and every handle destroyed. Close is idempotent and safe to call
// from any goroutine; it queues no GPU work.
func (l *Lib) Close() error {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || l.st == nil {
		return nil
	}
	l.closed = true
	return l.st.release()
}

// live returns the shared state, or an error naming call if l is closed.
func (l *Lib) live(call string) (*state, error) {
	if l == nil {
		return nil, fmt.Errorf("cublas: %s on a nil Lib: %w", call, hal.ErrClosed)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || l.st == nil {
		return nil, fmt.Errorf("cublas: %s on a closed Lib: %w", call, hal.ErrClosed)
	}
	return l.st, nil
}

// Libraries reports the loaded cuBLAS and cuBLASLt files and their versions
// (e.g. "13.1.0"). It needs no CUDA context, queues no GPU work and is safe to
// call from any goroutine. A closed Lib reports nothing.
func (l *Lib) Libraries() []hal.Library {
	st, err := l.live("Libraries")
	if err != nil {
		return nil
	}
	var out []hal.Library
	b := hal.Library{Name: "cublas", Version: st.blasVersion()}
	if st.blasLib != nil {
		b.Path = st.blasLib.Path()
	}
	out = append(out, b)
	lt := hal.Library{Name: "cublasLt"}
	if st.l.getVersion != nil {
		lt.Version = formatVersion(int(st.l.getVersion()))
	}
	if st.ltLib != nil {
		lt.Path = st.ltLib.Path()
	}
	return append(out, lt)
}

// blasVersion asks cublasGetProperty (no handle needed) for major, minor and
// patch; without it, cublasGetVersion_v2 with a NULL handle (the library
// ignores the handle there).
func (st *state) blasVersion() string {
	if p := st.b.getProperty; p != nil {
		var v [3]int32
		for i := range v {
			if p(int32(i), &v[i]) != 0 {
				return ""
			}
		}
		return fmt.Sprintf("%d.%d.%d", v[0], v[1], v[2])
	}
	if st.b.getVersion != nil {
		var v int32
		if st.b.getVersion(0, &v) == 0 {
			return formatVersion(int(v))
		}
	}
	return ""
}

// NewHandle creates a cuBLAS handle (cublasCreate_v2) on r's context, in host
// pointer mode and default math mode, bound to the legacy default stream until
// SetStream. computeMajor and computeMinor are the device's compute capability
// (TF32 needs 8.0 or newer). It runs synchronously inside r.Do and is safe to
// call from any goroutine.
func (l *Lib) NewHandle(r hal.Runner, computeMajor, computeMinor int) (hal.BlasHandle, error) {
	st, err := l.live("NewHandle")
	if err != nil {
		return nil, err
	}
	if r == nil {
		return nil, fmt.Errorf("cublas: NewHandle: nil hal.Runner; pass the CUDA device")
	}
	h := &handle{st: st, r: r, major: computeMajor, minor: computeMinor, native: st.b.gemmGroupedBatchedEx != nil && st.drvOK}
	err = r.Do(func() error {
		if err := st.b.statusError("cublasCreate_v2", st.b.create(&h.h)); err != nil {
			return err
		}
		if err := st.b.statusError("cublasSetPointerMode_v2", st.b.setPointerMod(h.h, pointerModeHost)); err != nil {
			st.b.destroy(h.h)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	st.acquire()
	return h, nil
}

// NewLtHandle creates a cuBLASLt handle (cublasLtCreate) on r's context. It
// runs synchronously inside r.Do and is safe to call from any goroutine.
func (l *Lib) NewLtHandle(r hal.Runner) (hal.LtHandle, error) {
	st, err := l.live("NewLtHandle")
	if err != nil {
		return nil, err
	}
	if r == nil {
		return nil, fmt.Errorf("cublas: NewLtHandle: nil hal.Runner; pass the CUDA device")
	}
	h := &ltHandle{st: st, r: r, plans: map[ltKey]*ltPlan{}}
	err = r.Do(func() error {
		return st.b.statusError("cublasLtCreate", st.l.create(&h.h))
	})
	if err != nil {
		return nil, err
	}
	st.acquire()
	return h, nil
}

// rawStream returns the CUstream of s, or an error naming call.
func rawStream(call string, s hal.Stream) (uintptr, error) {
	if s == nil {
		return 0, fmt.Errorf("%s: nil stream; pass a stream from the CUDA device", call)
	}
	rs, ok := s.(hal.RawStream)
	if !ok {
		return 0, fmt.Errorf("%s: stream %T is not a CUDA stream (no Handle() uintptr); pass a stream from the CUDA device", call, s)
	}
	return rs.Handle(), nil
}
