package conformance

import (
	"errors"
	"fmt"
	"testing"

	"github.com/gpuctx/gpuctx"
)

// TestGraphReplay captures BLAS work through a Context (two GEMMs of the
// split-K shape, so that they use a workspace) and checks that:
//   - nothing recorded runs during the capture: C keeps its contents;
//   - the capturing stream can be closed once EndCapture has returned, and
//     the graph then replays on another stream with the hand-checked answer;
//   - a replay reads the buffers' contents at launch time (new A, new C);
//   - replays on a third stream beside eager GEMMs of the same Context on
//     another stream give both right answers and, where the backend can
//     tell, never share a workspace with them;
//   - inputs are unchanged, Close is idempotent and Launch after it fails
//     with ErrClosed.
//
// A backend that cannot capture (ErrUnavailable from BeginCapture) skips it.
func TestGraphReplay(t *testing.T, dev *gpuctx.Device) {
	r := newRand(t)
	s1 := newStream(t, dev)
	ctx := newBlasContext(t, dev, s1)
	a1, b := intsF64(r, skM*skK, -3, 3), intsF64(r, skK*skN, -3, 3)
	bBytes := encode(gpuctx.F32, b)
	A, B := upload(t, dev, encode(gpuctx.F32, a1)), upload(t, dev, bBytes)
	poison := filled(4*skM*skN, 0x7f)
	C, C2 := upload(t, dev, poison), upload(t, dev, poison)
	must(t, "eager Blas before the capture", ctx.Blas(func(h gpuctx.Blas) error { return nil }))

	if err := s1.BeginCapture(); err != nil {
		if errors.Is(err, gpuctx.ErrUnavailable) {
			t.Skipf("the %s backend cannot capture: %v", dev.Backend(), err)
		}
		t.Fatalf("Stream.BeginCapture: %v", err)
	}
	err := ctx.Blas(func(h gpuctx.Blas) error {
		if err := h.Gemm(gemmF32(skM, skN, skK, 1, A, B, C)); err != nil {
			return err
		}
		return h.Gemm(gemmF32(skM, skN, skK, 0.5, A, B, C2))
	})
	g, err2 := s1.EndCapture()
	if err != nil || err2 != nil {
		t.Fatalf("capture: Blas: %v; EndCapture: %v", err, err2)
	}
	t.Cleanup(func() { _ = g.Close() })
	sameBytes(t, "C after the capture (nothing recorded may run)", download(t, dev, C), poison)

	must(t, "closing the capturing stream", s1.Close())
	s2 := newStream(t, dev)
	must(t, "Graph.Launch on another stream", g.Launch(s2))
	must(t, "Stream.Synchronize", s2.Synchronize())
	check := func(what string, a []float64) {
		t.Helper()
		sameVals(t, what+": C", gpuctx.F32, download(t, dev, C), refF32(skM, skN, skK, 1, a, b))
		sameVals(t, what+": C2", gpuctx.F32, download(t, dev, C2), refF32(skM, skN, skK, 0.5, a, b))
	}
	check("replay after the capturing stream closed", a1)

	// New inputs, and C poisoned again: the replay must recompute from them.
	a2 := intsF64(r, skM*skK, -3, 3)
	must(t, "CopyFromHost A", A.CopyFromHost(encode(gpuctx.F32, a2)))
	must(t, "CopyFromHost C", C.CopyFromHost(poison))
	s3 := newStream(t, dev)
	must(t, "Graph.Launch", g.Launch(s3))
	must(t, "Stream.Synchronize", s3.Synchronize())
	check("replay with new inputs", a2)

	// Replays on s3 beside eager GEMMs through the same Context on s2.
	_, err = ctx.SetStream(s2)
	must(t, "Context.SetStream", err)
	Ce := alloc(t, dev, 4*skM*skN)
	before := dev.WorkspaceConflicts()
	for i := range 4 {
		must(t, fmt.Sprintf("Graph.Launch %d", i), g.Launch(s3))
		must(t, fmt.Sprintf("eager GEMM %d", i), ctx.Blas(func(h gpuctx.Blas) error {
			return h.Gemm(gemmF32(skM, skN, skK, 1, A, B, Ce))
		}))
	}
	must(t, "Device.Synchronize", dev.Synchronize())
	check("replays beside eager work", a2)
	sameVals(t, "eager GEMM beside the replays", gpuctx.F32, download(t, dev, Ce), refF32(skM, skN, skK, 1, a2, b))
	if before >= 0 {
		if n := dev.WorkspaceConflicts() - before; n != 0 {
			t.Errorf("%d workspace conflicts between the graph and eager work", n)
		}
	}
	sameBytes(t, "A unchanged", download(t, dev, A), encode(gpuctx.F32, a2))
	sameBytes(t, "B unchanged", download(t, dev, B), bBytes)

	must(t, "Graph.Close", g.Close())
	must(t, "second Graph.Close", g.Close())
	if err := g.Launch(s2); !errors.Is(err, gpuctx.ErrClosed) {
		t.Errorf("Graph.Launch after Close: %v, want ErrClosed", err)
	}
}
