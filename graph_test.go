package gpuctx_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

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

// splitKShape is a GEMM shape for which the CPU backend computes split-K through
// the BLAS workspace (k >= 1024 and k >= 8*max(m, n)), so that a workspace that
// is freed or shared shows up as an error, a wrong result or a conflict.
const skM, skN, skK = 32, 32, 2048

// captureGemm captures c = a*b (split-K shape, f32) through ctx on s.
func captureGemm(t *testing.T, s *gpuctx.Stream, ctx *gpuctx.Context, a, b, c *gpuctx.Buffer) *gpuctx.Graph {
	t.Helper()
	if err := s.BeginCapture(); err != nil {
		t.Fatal(err)
	}
	err := ctx.Blas(func(h gpuctx.Blas) error {
		return h.Gemm(gpuctx.Gemm{M: skM, N: skN, K: skK, Alpha: 1, A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
	})
	g, err2 := s.EndCapture()
	if err != nil || err2 != nil {
		t.Fatalf("capture: Blas %v, EndCapture %v", err, err2)
	}
	t.Cleanup(func() { _ = g.Close() })
	return g
}

// A graph's BLAS calls use the graph's own workspace: the capturing stream can
// be closed (freeing its workspace) and the graph replayed on another stream.
func TestGraphOutlivesCapturingStream(t *testing.T) {
	d := openDevice(t, "cpu")
	r := rand.New(rand.NewPCG(21, 22))
	av, bv := randF32(r, skM*skK), randF32(r, skK*skN)
	a, b := upload(t, d, av), upload(t, d, bv)
	c := poison(t, d, skM*skN)
	s := newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	if err := ctx.Blas(func(gpuctx.Blas) error { return nil }); err != nil { // eager workspace first
		t.Fatal(err)
	}
	g := captureGemm(t, s, ctx, a, b, c)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n, _, _ := gpuctx.WorkspaceCounts(d); n != 0 {
		t.Fatalf("%d stream workspaces left after closing the only stream", n)
	}
	s2 := newStream(t, d)
	within(t, 60*time.Second, "replay", func() {
		if err := g.Launch(s2); err != nil {
			t.Error(err)
			return
		}
		if err := s2.Synchronize(); err != nil {
			t.Errorf("replay after the capturing stream closed: %v", err)
		}
	})
	checkClose(t, "replay", download(t, c), refGemm(gpuctx.RowMajor, false, false, skM, skN, skK, av, bv), 1e-4)
}

// Stream.WorkspaceBytes and Graph.WorkspaceBytes are the device memory the
// BLAS workspaces take: on the CPU backend MemInfo's free bytes fall by
// exactly their sum, and come back as the graph and the stream close.
func TestWorkspaceBytes(t *testing.T) {
	d := openDevice(t, "cpu")
	r := rand.New(rand.NewPCG(25, 26))
	a, b := upload(t, d, randF32(r, skM*skK)), upload(t, d, randF32(r, skK*skN))
	c := poison(t, d, skM*skN)
	s := newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	free := func() int64 {
		t.Helper()
		f, _, err := d.MemInfo()
		if err != nil {
			t.Fatal(err)
		}
		return int64(f)
	}
	free0 := free()
	if n := s.WorkspaceBytes(); n != 0 {
		t.Fatalf("WorkspaceBytes = %d before any BLAS call", n)
	}
	if err := ctx.Blas(func(gpuctx.Blas) error { return nil }); err != nil {
		t.Fatal(err)
	}
	ws := s.WorkspaceBytes()
	if ws < d.WorkspaceBytes() || free0-free() != int64(ws) {
		t.Fatalf("after a BLAS call: WorkspaceBytes %d (device size %d), free fell by %d", ws, d.WorkspaceBytes(), free0-free())
	}
	g := captureGemm(t, s, ctx, a, b, c)
	gws := g.WorkspaceBytes()
	if gws < d.WorkspaceBytes() || s.WorkspaceBytes() != ws || free0-free() != int64(ws+gws) {
		t.Fatalf("after a capture: graph %d, stream %d (was %d), free fell by %d", gws, s.WorkspaceBytes(), ws, free0-free())
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	if g.WorkspaceBytes() != 0 || free0-free() != int64(ws) {
		t.Fatalf("after Graph.Close: graph %d, free fell by %d, want %d", g.WorkspaceBytes(), free0-free(), ws)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if s.WorkspaceBytes() != 0 || free() != free0 {
		t.Fatalf("after Stream.Close: stream %d, free fell by %d", s.WorkspaceBytes(), free0-free())
	}
}

// Replaying a graph on a second stream while eager GEMMs run on the capturing
// stream: the two never share a workspace (the CPU backend's detector sees no
// conflict) and both results are right.
func TestGraphReplayBesideEagerWork(t *testing.T) {
	d := openDevice(t, "cpu")
	r := rand.New(rand.NewPCG(23, 24))
	av, bv := randF32(r, skM*skK), randF32(r, skK*skN)
	a, b := upload(t, d, av), upload(t, d, bv)
	cg, ce := poison(t, d, skM*skN), poison(t, d, skM*skN)
	s, s2 := newStream(t, d), newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	g := captureGemm(t, s, ctx, a, b, cg)
	before := d.WorkspaceConflicts()
	within(t, 120*time.Second, "replay beside eager GEMMs", func() {
		for range 8 {
			if err := g.Launch(s2); err != nil {
				t.Error(err)
				return
			}
			if err := ctx.Blas(func(h gpuctx.Blas) error {
				return h.Gemm(gpuctx.Gemm{M: skM, N: skN, K: skK, Alpha: 1, A: a, B: b, C: ce, AB: gpuctx.F32, CType: gpuctx.F32})
			}); err != nil {
				t.Error(err)
				return
			}
		}
		if err := d.Synchronize(); err != nil {
			t.Error(err)
		}
	})
	if n := d.WorkspaceConflicts() - before; n != 0 {
		t.Errorf("%d workspace conflicts between the graph and eager work", n)
	}
	want := refGemm(gpuctx.RowMajor, false, false, skM, skN, skK, av, bv)
	checkClose(t, "graph", download(t, cg), want, 1e-4)
	checkClose(t, "eager", download(t, ce), want, 1e-4)
}

// Launches of one graph on two streams from two goroutines are ordered (each
// waits for the previous launch): they never share the graph's workspace.
func TestGraphConcurrentLaunchesAreOrdered(t *testing.T) {
	d := openDevice(t, "cpu")
	r := rand.New(rand.NewPCG(25, 26))
	av, bv := randF32(r, skM*skK), randF32(r, skK*skN)
	a, b := upload(t, d, av), upload(t, d, bv)
	c := poison(t, d, skM*skN)
	s := newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	g := captureGemm(t, s, ctx, a, b, c)
	s1, s2 := newStream(t, d), newStream(t, d)
	before := d.WorkspaceConflicts()
	within(t, 120*time.Second, "concurrent launches", func() {
		var wg sync.WaitGroup
		for _, st := range []*gpuctx.Stream{s1, s2} {
			wg.Go(func() {
				for range 6 {
					if err := g.Launch(st); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		if err := d.Synchronize(); err != nil {
			t.Error(err)
		}
	})
	if n := d.WorkspaceConflicts() - before; n != 0 {
		t.Errorf("%d workspace conflicts between launches of one graph", n)
	}
	checkClose(t, "graph", download(t, c), refGemm(gpuctx.RowMajor, false, false, skM, skN, skK, av, bv), 1e-4)
	// Close waits for the launches, then frees the graph's workspace.
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
}

// Stream.Capture records what its function queues and always ends the
// capture: a failing function's error comes back with no graph, and the
// stream can capture again.
func TestStreamCapture(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		s := newStream(t, d)
		axpby, err := d.Kernel("gpuctx_axpby_f32")
		if err != nil {
			t.Fatal(err)
		}
		one, blk := gpuctx.Dim3{X: 1, Y: 1, Z: 1}, gpuctx.Dim3{X: 64, Y: 1, Z: 1}
		a := upload(t, d, []float32{1, 2, 3, 4})
		errFn := errors.New("queue failed")
		for _, tc := range []struct {
			name    string
			fn      func() error
			wantErr error
			want    []float32 // a after two launches
		}{
			{"records", func() error { return s.Launch(axpby, one, blk, 0, a, a, float32(1), float32(1), int64(4)) }, nil, []float32{4, 8, 12, 16}},
			{"fn fails", func() error { return errFn }, errFn, nil},
			{"records again", func() error { return s.Launch(axpby, one, blk, 0, a, a, float32(1), float32(1), int64(4)) }, nil, []float32{16, 32, 48, 64}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				g, err := s.Capture(tc.fn)
				if tc.wantErr != nil {
					if !errors.Is(err, tc.wantErr) || g != nil {
						t.Fatalf("Capture = %v, %v; want nil, %v", g, err, tc.wantErr)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				defer g.Close()
				for range 2 {
					if err := g.Launch(s); err != nil {
						t.Fatal(err)
					}
				}
				if err := s.Synchronize(); err != nil {
					t.Fatal(err)
				}
				if got := download(t, a); fmt.Sprint(got) != fmt.Sprint(tc.want) {
					t.Fatalf("a = %v after two launches, want %v", got, tc.want)
				}
			})
		}
	})
}
