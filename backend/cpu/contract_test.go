package cpu

import (
	"errors"
	"sync/atomic"
	"testing"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// TestHandleContract checks that the CPU backend's BLAS and cuBLASLt handles
// refuse, with ErrHandleMisuse, every call that breaks the handle contract,
// which a real cuBLAS handle would let through and corrupt silently: a call
// entering a handle while another is inside (held there by the Inside hook, so
// the overlap is certain, not timed), a use for a stream other than the one
// bound, and a GEMM after SetStream dropped the workspace. Each case also
// checks that the refusal is counted (Misuses) and reported (the Misuse hook),
// and that the same calls made correctly pass.
func TestHandleContract(t *testing.T) {
	cases := []struct {
		name string
		// broken makes the call that breaks the contract on a fresh device;
		// fixed makes the same calls correctly. Both return that call's error.
		broken, fixed func(t *testing.T, d *device, s, other *stream) error
	}{
		{"Blas entered twice at once", blasTwice(true), blasTwice(false)},
		{"BlasLt entered twice at once", ltTwice(true), ltTwice(false)},
		{"Blas checked for another stream", func(t *testing.T, d *device, s, other *stream) error {
			return boundHandle(t, d, s).CheckStream(other)
		}, func(t *testing.T, d *device, s, _ *stream) error {
			return boundHandle(t, d, s).CheckStream(s)
		}},
		{"BlasLt used on another stream", ltOn(true), ltOn(false)},
		{"Blas GEMM after SetStream dropped the workspace", blasRebind(false), blasRebind(true)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, broken := range []bool{true, false} {
				d := newTestDevice(t)
				s, other := newTestStream(t, d), newTestStream(t, d)
				var reported []error
				if _, err := SetHooks(d, Hooks{Misuse: func(err error) { reported = append(reported, err) }}); err != nil {
					t.Fatal(err)
				}
				fn := tc.fixed
				if broken {
					fn = tc.broken
				}
				err := fn(t, d, s, other)
				n, first := Misuses(d)
				switch {
				case broken && (!errors.Is(err, ErrHandleMisuse) || n != 1 || !errors.Is(first, ErrHandleMisuse) || len(reported) != 1):
					t.Errorf("broken: err %v, %d misuses (first %v), %d reported; want ErrHandleMisuse once", err, n, first, len(reported))
				case !broken && (err != nil || n != 0 || len(reported) != 0):
					t.Errorf("correct use: err %v, %d misuses, %d reported; want none", err, n, len(reported))
				}
				if err := s.Synchronize(); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// gemmIn returns a small f32 GEMM with operands on d.
func gemmIn(t *testing.T, d *device) hal.GemmDesc {
	g := hal.GemmDesc{M: 4, N: 4, K: 4, Alpha: 1, LDA: 4, LDB: 4, LDC: 4, AB: hal.F32, CType: hal.F32}
	setupGemm(t, d, &g, lcg(7))
	return g
}

// twice runs first on a goroutine and holds it inside the handle (the Inside
// hook blocks until released); with overlap, second is called meanwhile from
// this goroutine, else after first returned. It returns second's error, and
// fails t if first failed while second did not.
func twice(t *testing.T, d *device, call string, overlap bool, first, second func() error) error {
	in, release := make(chan struct{}), make(chan struct{})
	var held atomic.Bool // only the first call is held: a second one must not block
	if _, err := SetHooks(d, Hooks{Inside: func(c string) {
		if c == call && held.CompareAndSwap(false, true) {
			close(in)
			<-release
		}
	}, Misuse: d.calls.hooks.Load().Misuse}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- first() }()
	<-in
	var err error
	if overlap {
		err = second()
		close(release)
		<-done
	} else {
		close(release)
		if e := <-done; e != nil {
			t.Fatalf("first call: %v", e)
		}
		err = second()
	}
	return err
}

func blasTwice(overlap bool) func(t *testing.T, d *device, s, _ *stream) error {
	return func(t *testing.T, d *device, s, _ *stream) error {
		h := boundHandle(t, d, s)
		g := gemmIn(t, d)
		return twice(t, d, "BlasHandle.Gemm", overlap, func() error { return h.Gemm(g) }, func() error { return h.Gemm(g) })
	}
}

func ltTwice(overlap bool) func(t *testing.T, d *device, s, _ *stream) error {
	return func(t *testing.T, d *device, s, _ *stream) error {
		lt, err := d.NewLtHandle()
		if err != nil {
			t.Fatal(err)
		}
		g := gemmIn(t, d)
		mm := func() error { return lt.Matmul(s, g, 0, 0) }
		return twice(t, d, "LtHandle.Matmul", overlap, mm, mm)
	}
}

func ltOn(other bool) func(t *testing.T, d *device, s, o *stream) error {
	return func(t *testing.T, d *device, s, o *stream) error {
		h, err := d.NewLtHandle()
		if err != nil {
			t.Fatal(err)
		}
		lt := h.(*ltHandle)
		if err := lt.SetStream(s); err != nil {
			t.Fatal(err)
		}
		on := s
		if other {
			on = o
		}
		return lt.Matmul(on, gemmIn(t, d), 0, 0)
	}
}

func blasRebind(reapply bool) func(t *testing.T, d *device, s, o *stream) error {
	return func(t *testing.T, d *device, s, o *stream) error {
		h := boundHandle(t, d, s)
		ws, err := d.Alloc(1 << 12)
		if err != nil {
			t.Fatal(err)
		}
		if err := h.SetWorkspace(ws, 1<<12); err != nil {
			t.Fatal(err)
		}
		if err := h.SetStream(o); err != nil {
			t.Fatal(err)
		}
		if reapply {
			if err := h.SetWorkspace(ws, 1<<12); err != nil {
				t.Fatal(err)
			}
		}
		if err := h.Gemm(gemmIn(t, d)); err != nil {
			return err
		}
		return o.Synchronize()
	}
}
