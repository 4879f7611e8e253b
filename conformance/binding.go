package conformance

import (
	"errors"
	"fmt"
	"testing"

	"golang.org/x/sync/errgroup"

	"github.com/gpuctx/gpuctx"
)

// The split-K shape: large K against small M and N, so that backends that
// split K (the CPU backend, cuBLAS) use the stream's BLAS workspace. Small
// integer inputs keep every sum exact in f32 (|sum| <= 9*K < 2^24).
const skM, skN, skK = 32, 32, 2048

// gemmF32 is C = alpha*A*B (row-major, packed, f32).
func gemmF32(m, n, k int, alpha float64, a, b, c *gpuctx.Buffer) gpuctx.Gemm {
	return gpuctx.Gemm{M: m, N: n, K: k, Alpha: alpha, A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32}
}

// refF32 is the float64 reference of gemmF32 (beta 0).
func refF32(m, n, k int, alpha float64, a, b []float64) []float64 {
	am, bm, cm := gemmMats(gpuctx.RowMajor, false, false, m, n, k, [3]int{})
	c := make([]float64, m*n)
	refGemm(false, false, m, n, k, alpha, am, a, bm, b, 0, cm, c)
	return c
}

// ltAvailable reports whether the backend has the cuBLASLt path (BlasLt).
func ltAvailable(t *testing.T, ctx *gpuctx.Context) bool {
	err := ctx.BlasLt(func(gpuctx.BlasLt) error { return nil })
	if errors.Is(err, gpuctx.ErrUnavailable) {
		t.Logf("BlasLt not supported by this backend: %v", err)
		return false
	}
	must(t, "Context.BlasLt", err)
	return true
}

// TestContextStreamSwitching switches one Context back and forth between two
// streams, for both handle policies (pooled, and one shared handle, which is
// rebound on every switch and must get its stream's workspace back each
// time). Each iteration queues, on the stream it switched to, a kernel that
// fills that stream's A with a new value, a GEMM C = A*B through the Context
// (split-K shape: it uses the stream's workspace) and a copy of C to a buffer
// of its own: only a GEMM that runs on that stream, after the fill and before
// the copy, gives the hand-computed answer v*K in every copy. The handle must
// report that stream, and B must be unchanged. The same runs through BlasLt
// where the backend has it.
func TestContextStreamSwitching(t *testing.T, dev *gpuctx.Device) {
	fill := kernel(t, dev, "gpuctx_fill_f32")
	const iters = 12
	ones := make([]float64, skK*skN)
	for i := range ones {
		ones[i] = 1
	}
	B := upload(t, dev, encode(gpuctx.F32, ones))
	for _, pol := range []gpuctx.HandlePolicy{gpuctx.PooledHandles, gpuctx.SharedHandle} {
		for _, path := range []string{"Blas", "BlasLt"} {
			what := fmt.Sprintf("%v handles, %s", pol, path)
			s := [2]*gpuctx.Stream{newStream(t, dev), newStream(t, dev)}
			ctx, err := dev.NewContext(gpuctx.ContextOptions{Stream: s[0], Policy: pol})
			must(t, "Device.NewContext", err)
			t.Cleanup(func() { _ = ctx.Close() })
			if path == "BlasLt" && !ltAvailable(t, ctx) {
				continue
			}
			A := [2]*gpuctx.Buffer{alloc(t, dev, 4*skM*skK), alloc(t, dev, 4*skM*skK)}
			C := [2]*gpuctx.Buffer{alloc(t, dev, 4*skM*skN), alloc(t, dev, 4*skM*skN)}
			outs := make([]*gpuctx.Buffer, iters)
			for i := range outs {
				outs[i] = alloc(t, dev, 4*skM*skN)
			}
			grid, block := launchDims(skM * skK)
			for i := range iters {
				x := i % 2
				prev, err := ctx.SetStream(s[x])
				must(t, "Context.SetStream", err)
				if want := s[(i+1)%2]; i > 0 && prev != want {
					t.Fatalf("%s: SetStream returned stream %d as the previous one, want %d", what, prev.ID(), want.ID())
				}
				must(t, "Launch fill", s[x].Launch(fill, grid, block, 0, A[x], float32(i%7+1), int64(skM*skK)))
				g := gemmF32(skM, skN, skK, 1, A[x], B, C[x])
				check := func(got *gpuctx.Stream) error {
					if got != s[x] {
						return fmt.Errorf("the handle reports stream %v, want the Context's current stream %d", got, s[x].ID())
					}
					return nil
				}
				if path == "Blas" {
					err = ctx.Blas(func(h gpuctx.Blas) error {
						if err := check(h.Stream()); err != nil {
							return err
						}
						return h.Gemm(g)
					})
				} else {
					err = ctx.BlasLt(func(lt gpuctx.BlasLt) error {
						if err := check(lt.Stream()); err != nil {
							return err
						}
						return lt.Matmul(g)
					})
				}
				must(t, fmt.Sprintf("%s: iteration %d on stream %d", what, i, s[x].ID()), err)
				must(t, "Stream.CopyDtoD", s[x].CopyDtoD(outs[i], 0, C[x], 0, 4*skM*skN))
			}
			must(t, "Device.Synchronize", dev.Synchronize())
			for i, o := range outs {
				want := make([]float64, skM*skN)
				for j := range want {
					want[j] = float64((i%7 + 1) * skK)
				}
				sameVals(t, fmt.Sprintf("%s: iteration %d", what, i), gpuctx.F32, download(t, dev, o), want)
			}
		}
	}
	sameVals(t, "B unchanged", gpuctx.F32, download(t, dev, B), ones)
}

// TestContextConcurrentViews drives one Context (pooled handles, then one
// shared handle that every callback rebinds) from several goroutines at once,
// each through its own view (Context.WithStream) on its own stream,
// alternating Blas and BlasLt (where the backend has it) GEMMs of the split-K
// shape with inputs of its own. Every result must equal the float64 reference
// exactly and no input may change. Streams share the Context's handles but
// never a workspace: where the backend can tell (Device.WorkspaceConflicts >=
// 0, the CPU backend), it must have seen no workspace used by two streams at
// once; elsewhere a shared workspace shows as wrong results.
func TestContextConcurrentViews(t *testing.T, dev *gpuctx.Device) {
	for _, pol := range []gpuctx.HandlePolicy{gpuctx.PooledHandles, gpuctx.SharedHandle} {
		t.Run(pol.String(), func(t *testing.T) { testConcurrentViews(t, dev, pol) })
	}
}

func testConcurrentViews(t *testing.T, dev *gpuctx.Device, pol gpuctx.HandlePolicy) {
	const workers, iters = 4, 6
	r := newRand(t)
	ctx, err := dev.NewContext(gpuctx.ContextOptions{Stream: newStream(t, dev), Policy: pol})
	must(t, "Device.NewContext", err)
	t.Cleanup(func() { _ = ctx.Close() })
	lt := ltAvailable(t, ctx)
	type worker struct {
		view           *gpuctx.Context
		a, b           []float64
		A, B, C        *gpuctx.Buffer
		outs           []*gpuctx.Buffer
		want           []float64
		aBytes, bBytes []byte
	}
	ws := make([]*worker, workers)
	for i := range ws {
		w := &worker{a: intsF64(r, skM*skK, -3, 3), b: intsF64(r, skK*skN, -3, 3)}
		w.aBytes, w.bBytes = encode(gpuctx.F32, w.a), encode(gpuctx.F32, w.b)
		w.A, w.B, w.C = upload(t, dev, w.aBytes), upload(t, dev, w.bBytes), alloc(t, dev, 4*skM*skN)
		for range iters {
			w.outs = append(w.outs, alloc(t, dev, 4*skM*skN))
		}
		w.want = refF32(skM, skN, skK, 1, w.a, w.b)
		v, err := ctx.WithStream(newStream(t, dev))
		must(t, "Context.WithStream", err)
		w.view = v
		ws[i] = w
	}
	before := dev.WorkspaceConflicts()
	var g errgroup.Group
	for i, w := range ws {
		g.Go(func() error {
			s := w.view.Stream()
			for it := range iters {
				g := gemmF32(skM, skN, skK, 1, w.A, w.B, w.C)
				var err error
				if lt && (it+i)%2 == 1 {
					err = w.view.BlasLt(func(h gpuctx.BlasLt) error { return h.Matmul(g) })
				} else {
					err = w.view.Blas(func(h gpuctx.Blas) error { return h.Gemm(g) })
				}
				if err == nil {
					err = s.CopyDtoD(w.outs[it], 0, w.C, 0, 4*skM*skN)
				}
				if err != nil {
					return fmt.Errorf("worker %d iteration %d: %w", i, it, err)
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Error(err) // the first worker's error; the results are checked all the same
	}
	must(t, "Device.Synchronize", dev.Synchronize())
	for i, w := range ws {
		for it, o := range w.outs {
			sameVals(t, fmt.Sprintf("worker %d iteration %d", i, it), gpuctx.F32, download(t, dev, o), w.want)
		}
		sameBytes(t, fmt.Sprintf("worker %d: A unchanged", i), download(t, dev, w.A), w.aBytes)
		sameBytes(t, fmt.Sprintf("worker %d: B unchanged", i), download(t, dev, w.B), w.bBytes)
	}
	if before >= 0 {
		if n := dev.WorkspaceConflicts() - before; n != 0 {
			t.Errorf("the backend saw a BLAS workspace used by two streams at once %d times", n)
		}
	} else {
		t.Logf("the %s backend cannot detect workspace sharing; results were checked", dev.Backend())
	}
}
