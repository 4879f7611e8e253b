package gpuctx_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// A graph captured from two streams (a kernel chain on the main stream, a GEMM
// through a Context on a side stream forked and joined with events, and a copy
// back on the main stream) computes the same thing every time it is launched,
// reading the inputs' current contents; nothing runs during the capture.
func TestGraphCaptureAndReplay(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		r := rand.New(rand.NewPCG(11, 12))
		const m, n, k = 8, 12, 16
		main, side := newStream(t, d), newStream(t, d)
		a, b := upload(t, d, make([]float32, m*k)), upload(t, d, make([]float32, k*n))
		c := poison(t, d, m*n)
		y := poison(t, d, m*n)
		ctx := newContext(t, d, gpuctx.ContextOptions{Stream: side})
		axpby, err := d.Kernel("gpuctx_axpby_f32")
		if err != nil {
			t.Fatal(err)
		}
		fork, _ := d.NewEvent(false)
		join, _ := d.NewEvent(false)
		one := gpuctx.Dim3{X: 1, Y: 1, Z: 1}
		blk := gpuctx.Dim3{X: 64, Y: 1, Z: 1}
		// Create the side stream's handle and workspace outside the capture, as any
		// warm-up would: library setup does not belong in a graph.
		if err := ctx.Blas(func(gpuctx.Blas) error { return nil }); err != nil {
			t.Fatal(err)
		}

		if err := main.BeginCapture(); err != nil {
			t.Fatal(err)
		}
		// a = 2*a on main; then the side stream computes c = a*b; main copies c to y.
		must := func(what string, err error) {
			t.Helper()
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
		}
		must("launch", main.Launch(axpby, one, blk, 0, a, a, float32(1), float32(1), int64(m*k)))
		must("record fork", fork.Record(main))
		must("side waits", side.Wait(fork))
		must("gemm", ctx.Blas(func(h gpuctx.Blas) error {
			return h.Gemm(gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
		}))
		must("record join", join.Record(side))
		must("main waits", main.Wait(join))
		must("copy", main.CopyDtoD(y, 0, c, 0, 4*m*n))
		g, err := main.EndCapture()
		if err != nil {
			t.Fatal(err)
		}
		defer g.Close()
		if got := download(t, y); got[0] == got[0] { // still NaN: nothing ran during the capture
			t.Fatalf("the capture ran work: y[0] = %v", got[0])
		}
		for round := range 3 {
			av, bv := randF32(r, m*k), randF32(r, k*n)
			if err := a.CopyFromHost(f32bytes(av)); err != nil {
				t.Fatal(err)
			}
			if err := b.CopyFromHost(f32bytes(bv)); err != nil {
				t.Fatal(err)
			}
			if err := g.Launch(main); err != nil {
				t.Fatal(err)
			}
			if err := main.Synchronize(); err != nil {
				t.Fatal(err)
			}
			a2 := make([]float32, len(av))
			for i, v := range av {
				a2[i] = 2 * v
			}
			checkClose(t, fmt.Sprintf("round %d", round), download(t, y), refGemm(gpuctx.RowMajor, false, false, m, n, k, a2, bv), 1e-5)
		}
		if err := g.Close(); err != nil {
			t.Fatal(err)
		}
		if err := g.Launch(main); !errors.Is(err, gpuctx.ErrClosed) {
			t.Fatalf("Launch after Close: want ErrClosed, got %v", err)
		}
	})
}

// Host waits on a capturing stream are refused, not deadlocked, and the stream
// is usable once the capture ends (CUDA invalidates the capture: EndCapture may
// then fail too).
func TestGraphCaptureRefusesHostWaits(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		s := newStream(t, d)
		if err := s.BeginCapture(); err != nil {
			t.Fatal(err)
		}
		if err := s.Synchronize(); err == nil {
			t.Fatal("Synchronize of a capturing stream succeeded")
		}
		if g, err := s.EndCapture(); err == nil {
			_ = g.Close()
		} else {
			t.Logf("EndCapture after the refused wait: %v", err)
		}
		if err := s.Synchronize(); err != nil {
			t.Fatalf("stream unusable after the capture ended: %v", err)
		}
	})
}
