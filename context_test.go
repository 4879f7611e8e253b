package gpuctx_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/internal/blas"
	"github.com/gpuctx/gpuctx/internal/blastest"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// blasDevices returns the CPU device and, where one works, the first CUDA
// device, each closed at the end of the test.
func blasDevices(t *testing.T) []*gpuctx.Device {
	t.Helper()
	var devs []*gpuctx.Device
	for _, name := range []string{"cpu", "cuda"} {
		rt, err := gpuctx.OpenBackend(name)
		if err != nil {
			t.Logf("backend %s not run: %v", name, err)
			continue
		}
		t.Cleanup(func() { _ = rt.Close() })
		d, err := rt.Device(0)
		if err != nil {
			t.Fatalf("%s: Device(0): %v", name, err)
		}
		t.Logf("backend %s: %s", name, d.Info().Name)
		devs = append(devs, d)
	}
	return devs
}

func eachDevice(t *testing.T, fn func(t *testing.T, d *gpuctx.Device)) {
	for _, d := range blasDevices(t) {
		t.Run(d.Backend(), func(t *testing.T) { fn(t, d) })
	}
}

func f32bytes(x []float32) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 4*len(x)) }

func randF32(r *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64())
	}
	return x
}

func upload(t *testing.T, d *gpuctx.Device, x []float32) *gpuctx.Buffer {
	t.Helper()
	b, err := d.Alloc(4 * len(x))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.CopyFromHost(f32bytes(x)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Free() })
	return b
}

func download(t *testing.T, b *gpuctx.Buffer) []float32 {
	t.Helper()
	x := make([]float32, b.Size()/4)
	if err := b.CopyToHost(f32bytes(x)); err != nil {
		t.Fatal(err)
	}
	return x
}

func poison(t *testing.T, d *gpuctx.Device, n int) *gpuctx.Buffer {
	t.Helper()
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(math.NaN())
	}
	return upload(t, d, x)
}

func to64(x []float32) []float64 {
	y := make([]float64, len(x))
	for i, v := range x {
		y[i] = float64(v)
	}
	return y
}

// refGemm is the float64 reference of a packed f32 GEMM.
func refGemm(layout gpuctx.Layout, ta, tb bool, m, n, k int, a, b []float32) []float64 {
	sh := blas.GemmShape{Layout: blas.Layout(layout), TransA: ta, TransB: tb, M: m, N: n, K: k, AB: hal.F32, C: hal.F32,
		ALen: len(a), BLen: len(b), CLen: m * n}
	if err := sh.Normalize(); err != nil {
		panic(err)
	}
	c := make([]float64, m*n)
	blastest.RefGemm(sh, 1, to64(a), to64(b), 0, c)
	return c
}

func checkClose(t *testing.T, what string, got []float32, want []float64, tol float64) {
	t.Helper()
	if e := blastest.RelErr(to64(got), want); !(e <= tol) {
		t.Fatalf("%s: relative error %.3g > %.1g", what, e, tol)
	}
}

// busy queues a long chain of kernels on s so that work misrouted to s would
// not have completed when another stream is synchronised.
func busy(t *testing.T, d *gpuctx.Device, s *gpuctx.Stream, scratch *gpuctx.Buffer, launches int) {
	t.Helper()
	k, err := d.Kernel("gpuctx_axpby_f32")
	if err != nil {
		t.Fatal(err)
	}
	n := int64(scratch.Size() / 4)
	for range launches {
		if err := s.Launch(k, gpuctx.Dim3{X: 256, Y: 1, Z: 1}, gpuctx.Dim3{X: 256, Y: 1, Z: 1}, 0, scratch, scratch, float32(0.5), float32(0.5), n); err != nil {
			t.Fatal(err)
		}
	}
}

func newStream(t *testing.T, d *gpuctx.Device) *gpuctx.Stream {
	t.Helper()
	s, err := d.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func newContext(t *testing.T, d *gpuctx.Device, o gpuctx.ContextOptions) *gpuctx.Context {
	t.Helper()
	c, err := d.NewContext(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Test 1: a GEMM queued through the callback on a non-default stream, behind an
// event wait, runs after the event: its input is written on another stream just
// before the event is recorded.
func TestGemmOrderedBehindEvent(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		r := rand.New(rand.NewPCG(1, 2))
		const m, n, k = 64, 48, 96
		a, b := randF32(r, m*k), randF32(r, k*n)
		aDev := poison(t, d, m*k) // holds NaN until the producer stream writes a
		bDev := upload(t, d, b)
		cDev := poison(t, d, m*n)
		producer, consumer := newStream(t, d), newStream(t, d)
		host, err := d.AllocHost(4 * m * k)
		if err != nil {
			t.Fatal(err)
		}
		copy(host.Bytes(), f32bytes(a))
		scratch := poison(t, d, 1<<20)
		if err := producer.Memset(scratch, 0); err != nil {
			t.Fatal(err)
		}
		busy(t, d, producer, scratch, 200)
		if err := producer.CopyHtoD(aDev, 0, host, 0, 4*m*k); err != nil {
			t.Fatal(err)
		}
		ev, err := d.NewEvent(false)
		if err != nil {
			t.Fatal(err)
		}
		if err := ev.Record(producer); err != nil {
			t.Fatal(err)
		}
		if err := consumer.Wait(ev); err != nil {
			t.Fatal(err)
		}
		ctx := newContext(t, d, gpuctx.ContextOptions{Stream: consumer})
		err = ctx.Blas(func(h gpuctx.Blas) error {
			if h.Stream() != consumer {
				return fmt.Errorf("handle on stream %d, want consumer %d", h.Stream().ID(), consumer.ID())
			}
			return h.Gemm(gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: aDev, B: bDev, C: cDev, AB: gpuctx.F32, CType: gpuctx.F32})
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := consumer.Synchronize(); err != nil {
			t.Fatal(err)
		}
		checkClose(t, "gemm behind event", download(t, cDev), refGemm(gpuctx.RowMajor, false, false, m, n, k, a, b), 1e-5)
	})
}

// busyLen is the length of the kernel chain that keeps the other stream busy:
// shorter under -short (CI's race step), where the CPU backend's handles
// refuse a GEMM on a stream other than the bound one whatever the timing.
func busyLen() int {
	if testing.Short() {
		return 20
	}
	return 100
}

// Test 2: one Context, the same object throughout, switched between streams A
// and B; each GEMM is checked after synchronising only its own stream while the
// other stream is kept busy, so a GEMM issued on the wrong stream shows up.
func TestContextSwitchesStreams(t *testing.T) {
	const iters = 10
	for _, pol := range []gpuctx.HandlePolicy{gpuctx.SharedHandle, gpuctx.PooledHandles} {
		t.Run(pol.String(), func(t *testing.T) {
			eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
				r := rand.New(rand.NewPCG(3, 4))
				sA, sB := newStream(t, d), newStream(t, d)
				ctx := newContext(t, d, gpuctx.ContextOptions{Stream: sA, Policy: pol})
				// one scratch buffer per stream: the busy chains of A and B may overlap
				scratch := map[*gpuctx.Stream]*gpuctx.Buffer{sA: upload(t, d, randF32(r, 1<<20)), sB: upload(t, d, randF32(r, 1<<20))}
				const m, n, k = 33, 65, 129
				for i := range iters {
					cur, other := sA, sB
					if i%2 == 1 {
						cur, other = sB, sA
					}
					if _, err := ctx.SetStream(cur); err != nil {
						t.Fatal(err)
					}
					busy(t, d, other, scratch[other], busyLen())
					layout := []gpuctx.Layout{gpuctx.RowMajor, gpuctx.ColMajor}[i%2]
					ta, tb := i%3 == 0, i%4 == 1
					a, b := randF32(r, m*k), randF32(r, k*n)
					aDev, bDev, cDev := upload(t, d, a), upload(t, d, b), poison(t, d, m*n)
					err := ctx.Blas(func(h gpuctx.Blas) error {
						if err := checkBinding(h, cur); err != nil {
							return fmt.Errorf("iteration %d: %w", i, err)
						}
						return h.Gemm(gpuctx.Gemm{Layout: layout, TransA: ta, TransB: tb, M: m, N: n, K: k, Alpha: 1,
							A: aDev, B: bDev, C: cDev, AB: gpuctx.F32, CType: gpuctx.F32})
					})
					if err != nil {
						t.Fatal(err)
					}
					if err := cur.Synchronize(); err != nil {
						t.Fatal(err)
					}
					checkClose(t, fmt.Sprintf("iteration %d (%v ta=%v tb=%v)", i, layout, ta, tb), download(t, cDev), refGemm(layout, ta, tb, m, n, k, a, b), 1e-5)
				}
				st := ctx.Stats()
				t.Logf("%s/%s: %+v", d.Backend(), pol, st)
				switch pol {
				case gpuctx.SharedHandle:
					// One handle: every switch is a rebind, and the workspace is applied
					// again after each bind (cublasSetStream resets it).
					if st.HandlesCreated != 1 || st.Rebinds != iters-1 || st.Binds != iters || st.WorkspaceApplies != iters {
						t.Fatalf("shared policy: want 1 handle, %d rebinds, %d binds, %d workspace applications; got %+v", iters-1, iters, iters, st)
					}
				case gpuctx.PooledHandles:
					// Pooled: each stream keeps its own handle, so switching costs no rebind.
					if st.HandlesCreated > 2 || st.Rebinds != 0 || st.WorkspaceApplies != st.Binds {
						t.Fatalf("pooled policy: want <= 2 handles and no rebinds; got %+v", st)
					}
				}
			})
		})
	}
}

// concurrentGemms runs goroutines x perG split-K-prone GEMMs, each goroutine on
// its own stream through ctxFor(g), and checks every result.
func concurrentGemms(t *testing.T, d *gpuctx.Device, goroutines, perG int, ctxFor func(g int, s *gpuctx.Stream) *gpuctx.Context) (bad int) {
	t.Helper()
	const m, n, k, sets = 8, 8, 4096, 3
	r := rand.New(rand.NewPCG(5, 6))
	type input struct {
		a, b *gpuctx.Buffer
		want []float64
	}
	var ins [sets]input
	for i := range ins {
		a, b := randF32(r, m*k), randF32(r, k*n)
		ins[i] = input{upload(t, d, a), upload(t, d, b), refGemm(gpuctx.RowMajor, false, false, m, n, k, a, b)}
	}
	outs := make([]*gpuctx.Buffer, goroutines)
	for g := range outs {
		outs[g] = poison(t, d, perG*m*n)
	}
	var wg sync.WaitGroup
	errs := make([]error, goroutines)
	for g := range goroutines {
		s := newStream(t, d)
		ctx := ctxFor(g, s)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perG {
				in := ins[(g+i)%sets]
				c, err := outs[g].Slice(4*m*n*i, 4*m*n)
				if err == nil {
					err = ctx.Blas(func(h gpuctx.Blas) error {
						if h.Stream() != s {
							return fmt.Errorf("goroutine %d: handle on stream %d, want %d", g, h.Stream().ID(), s.ID())
						}
						return h.Gemm(gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: in.a, B: in.b, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
					})
				}
				if err != nil {
					errs[g] = err
					return
				}
			}
			errs[g] = s.Synchronize()
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for g := range goroutines {
		got := download(t, outs[g])
		for i := range perG {
			if e := blastest.RelErr(to64(got[i*m*n:(i+1)*m*n]), ins[(g+i)%sets].want); !(e <= 1e-5) {
				bad++
			}
		}
	}
	return bad
}

// Test 3: 8 goroutines, each on its own stream, 200 split-K-prone GEMMs each,
// through one shared Context (a view per goroutine) and through separate
// Contexts, for both handle policies. Every result must be right and no
// workspace may be used by two streams at once.
func TestConcurrentStreamsNoWorkspaceSharing(t *testing.T) {
	const goroutines = 8
	perG := 200
	if testing.Short() { // CI's race step: the CPU handles catch a shared workspace on any call
		perG = 50
	}
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		for _, pol := range []gpuctx.HandlePolicy{gpuctx.PooledHandles, gpuctx.SharedHandle} {
			for _, shared := range []bool{true, false} {
				name := fmt.Sprintf("%s/sharedContext=%v", pol, shared)
				t.Run(name, func(t *testing.T) {
					before := d.WorkspaceConflicts()
					root := newContext(t, d, gpuctx.ContextOptions{Policy: pol})
					bad := concurrentGemms(t, d, goroutines, perG, func(g int, s *gpuctx.Stream) *gpuctx.Context {
						if shared {
							v, err := root.WithStream(s)
							if err != nil {
								t.Fatal(err)
							}
							return v
						}
						return newContext(t, d, gpuctx.ContextOptions{Stream: s, Policy: pol})
					})
					if bad != 0 {
						t.Fatalf("%d of %d GEMMs wrong", bad, goroutines*perG)
					}
					if after := d.WorkspaceConflicts(); after >= 0 && after != before {
						t.Fatalf("workspace used by two streams at once %d times", after-before)
					}
					t.Logf("%s: stats of the shared context: %+v", name, root.Stats())
				})
			}
		}
	})
}

// The detector behind test 3 is known to work: forcing the shared-workspace
// design (one workspace for every stream) makes it fire on the CPU backend.
func TestSharedWorkspaceIsDetected(t *testing.T) {
	rt, err := gpuctx.OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	d, err := rt.Device(0)
	if err != nil {
		t.Fatal(err)
	}
	root := newContext(t, d, gpuctx.ContextOptions{Policy: gpuctx.SharedHandle, UnsafeSharedWorkspace: true})
	before := d.WorkspaceConflicts()
	bad := concurrentGemms(t, d, 8, 100, func(g int, s *gpuctx.Stream) *gpuctx.Context {
		v, err := root.WithStream(s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	})
	conflicts := d.WorkspaceConflicts() - before
	t.Logf("shared workspace: %d conflicts, %d wrong results", conflicts, bad)
	if conflicts == 0 {
		t.Fatal("the workspace-sharing detector did not fire although every stream shared one workspace")
	}
}

// Test 4: grouped GEMM and Geam go through the same binding: one Context is
// switched between two streams between calls; each call lands on the stream that
// was current and is correct.
func TestGroupedAndGeamFollowStream(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		r := rand.New(rand.NewPCG(7, 8))
		sA, sB := newStream(t, d), newStream(t, d)
		ctx := newContext(t, d, gpuctx.ContextOptions{Stream: sA, Policy: gpuctx.SharedHandle})
		scratch := map[*gpuctx.Stream]*gpuctx.Buffer{sA: upload(t, d, randF32(r, 1<<20)), sB: upload(t, d, randF32(r, 1<<20))}
		shapes := [][3]int{{5, 7, 9}, {16, 3, 64}, {1, 33, 17}, {0, 8, 8}}
		for round, cur := range []*gpuctx.Stream{sA, sB, sA} {
			other := sB
			if cur == sB {
				other = sA
			}
			if _, err := ctx.SetStream(cur); err != nil {
				t.Fatal(err)
			}
			busy(t, d, other, scratch[other], 100)
			var gs []gpuctx.Gemm
			var wants [][]float64
			var outs []*gpuctx.Buffer
			for _, sh := range shapes {
				m, n, k := sh[0], sh[1], sh[2]
				a, b := randF32(r, max(1, m*k)), randF32(r, k*n)
				c := poison(t, d, max(1, m*n))
				gs = append(gs, gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: upload(t, d, a), B: upload(t, d, b), C: c, AB: gpuctx.F32, CType: gpuctx.F32})
				wants = append(wants, refGemm(gpuctx.RowMajor, false, false, m, n, k, a[:m*k], b))
				outs = append(outs, c)
			}
			const gm, gn = 19, 23
			ga, gb := randF32(r, gm*gn), randF32(r, gm*gn)
			gaDev, gbDev, gcDev := upload(t, d, ga), upload(t, d, gb), poison(t, d, gm*gn)
			err := ctx.Blas(func(h gpuctx.Blas) error {
				if h.Stream() != cur {
					return fmt.Errorf("round %d: handle on stream %d, want %d", round, h.Stream().ID(), cur.ID())
				}
				if err := h.GemmGrouped(gs); err != nil {
					return err
				}
				// C = 2*A^T... here plain: C = 0.5*A - 2*B (row-major, no transposes).
				return h.Geam(gpuctx.Geam{M: gm, N: gn, Alpha: 0.5, Beta: -2, A: gaDev, B: gbDev, C: gcDev, Type: gpuctx.F32})
			})
			if err != nil {
				t.Fatal(err)
			}
			if err := cur.Synchronize(); err != nil {
				t.Fatal(err)
			}
			for i, want := range wants {
				if len(want) == 0 {
					continue
				}
				checkClose(t, fmt.Sprintf("round %d group %d", round, i), download(t, outs[i])[:len(want)], want, 1e-5)
			}
			gwant := make([]float64, gm*gn)
			for i := range gwant {
				gwant[i] = 0.5*float64(ga[i]) - 2*float64(gb[i])
			}
			checkClose(t, fmt.Sprintf("round %d geam", round), download(t, gcDev), gwant, 1e-6)
		}
		if st := ctx.Stats(); st.Rebinds != 2 {
			t.Fatalf("want 2 rebinds for A->B->A, got %+v", st)
		}
	})
}

// Test 5: a callback that panics or returns an error releases the handle's lock
// and leaves the Context usable.
func TestCallbackPanicOrErrorLeavesContextUsable(t *testing.T) {
	boom := errors.New("boom")
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		for _, pol := range []gpuctx.HandlePolicy{gpuctx.SharedHandle, gpuctx.PooledHandles} {
			if err := d.SetBlasHandleLimit(1); err != nil { // pooled: a leaked lock would deadlock
				t.Fatal(err)
			}
			ctx := newContext(t, d, gpuctx.ContextOptions{Policy: pol})
			if err := ctx.Blas(func(gpuctx.Blas) error { return boom }); !errors.Is(err, boom) {
				t.Fatalf("%s: want the callback's error, got %v", pol, err)
			}
			func() {
				defer func() {
					if recover() == nil {
						t.Fatalf("%s: the callback's panic was swallowed", pol)
					}
				}()
				_ = ctx.Blas(func(gpuctx.Blas) error { panic("callback panics") })
			}()
			a := upload(t, d, []float32{1, 2, 3, 4})
			c := poison(t, d, 4)
			err := ctx.Blas(func(h gpuctx.Blas) error {
				return h.Gemm(gpuctx.Gemm{M: 2, N: 2, K: 2, Alpha: 1, A: a, B: a, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
			})
			if err != nil {
				t.Fatalf("%s: context unusable after panic: %v", pol, err)
			}
			if err := ctx.Stream().Synchronize(); err != nil {
				t.Fatal(err)
			}
			if got := download(t, c); got[0] != 7 || got[1] != 10 || got[2] != 15 || got[3] != 22 {
				t.Fatalf("%s: [[1 2][3 4]]^2 = %v", pol, got)
			}
		}
		if err := d.SetBlasHandleLimit(gpuctx.DefaultMaxHandles); err != nil {
			t.Fatal(err)
		}
	})
}

// Test 6: a handle used after its callback returned gives ErrHandleExpired and
// queues nothing.
func TestHandleExpiresWithCallback(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		ctx := newContext(t, d, gpuctx.ContextOptions{})
		var kept gpuctx.Blas
		var keptLt gpuctx.BlasLt
		if err := ctx.Blas(func(h gpuctx.Blas) error { kept = h; return nil }); err != nil {
			t.Fatal(err)
		}
		if err := ctx.BlasLt(func(lt gpuctx.BlasLt) error { keptLt = lt; return nil }); err != nil {
			t.Fatal(err)
		}
		a := upload(t, d, []float32{1, 2, 3, 4})
		c := upload(t, d, []float32{9, 9, 9, 9})
		g := gpuctx.Gemm{M: 2, N: 2, K: 2, Alpha: 1, A: a, B: a, C: c, AB: gpuctx.F32, CType: gpuctx.F32}
		if err := kept.Gemm(g); !errors.Is(err, gpuctx.ErrHandleExpired) {
			t.Fatalf("Gemm after the callback: want ErrHandleExpired, got %v", err)
		}
		if err := kept.GemmGrouped([]gpuctx.Gemm{g}); !errors.Is(err, gpuctx.ErrHandleExpired) {
			t.Fatalf("GemmGrouped after the callback: want ErrHandleExpired, got %v", err)
		}
		if err := keptLt.Matmul(g); !errors.Is(err, gpuctx.ErrHandleExpired) {
			t.Fatalf("Matmul after the callback: want ErrHandleExpired, got %v", err)
		}
		if err := ctx.Stream().Synchronize(); err != nil {
			t.Fatal(err)
		}
		if got := download(t, c); got[0] != 9 || got[3] != 9 {
			t.Fatalf("an expired handle wrote C: %v", got)
		}
	})
}

// Bad arguments are rejected before the library is called, with an error that
// names the argument and its value.
func TestGemmValidation(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		ctx := newContext(t, d, gpuctx.ContextOptions{})
		small := upload(t, d, make([]float32, 8))
		big := upload(t, d, make([]float32, 64))
		freed, err := d.Alloc(256)
		if err != nil {
			t.Fatal(err)
		}
		if err := freed.Free(); err != nil {
			t.Fatal(err)
		}
		cases := []struct {
			name string
			g    gpuctx.Gemm
			is   error
			text string
		}{
			{"negative m", gpuctx.Gemm{M: -1, N: 2, K: 2, A: big, B: big, C: big, AB: gpuctx.F32, CType: gpuctx.F32}, gpuctx.ErrInvalid, "m=-1"},
			{"A too small", gpuctx.Gemm{M: 4, N: 4, K: 4, A: small, B: big, C: big, AB: gpuctx.F32, CType: gpuctx.F32}, gpuctx.ErrInvalid, "A needs 16 elements"},
			{"lda too small", gpuctx.Gemm{M: 4, N: 4, K: 4, LDA: 2, A: big, B: big, C: big, AB: gpuctx.F32, CType: gpuctx.F32}, gpuctx.ErrInvalid, "lda=2"},
			{"bad dtypes", gpuctx.Gemm{M: 2, N: 2, K: 2, A: big, B: big, C: big, AB: gpuctx.F32, CType: gpuctx.BF16}, gpuctx.ErrInvalid, "A/B=f32 C=bf16"},
			{"nil C", gpuctx.Gemm{M: 2, N: 2, K: 2, A: big, B: big, AB: gpuctx.F32, CType: gpuctx.F32}, gpuctx.ErrInvalid, "C is nil"},
			{"freed B", gpuctx.Gemm{M: 2, N: 2, K: 2, A: big, B: freed, C: big, AB: gpuctx.F32, CType: gpuctx.F32}, gpuctx.ErrFreed, "B"},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				err := ctx.Blas(func(h gpuctx.Blas) error { return h.Gemm(tc.g) })
				if !errors.Is(err, tc.is) || !contains(err.Error(), tc.text) {
					t.Fatalf("want %v mentioning %q, got %v", tc.is, tc.text, err)
				}
			})
		}
	})
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

// Calls through one lent handle from several goroutines inside the callback are
// serialised on the handle and all land on the callback's stream; a goroutine
// that goes on calling after the callback returned gets ErrHandleExpired, even
// while a later callback holds the same handle on another stream.
func TestHandleSharedByGoroutinesInsideCallback(t *testing.T) {
	eachDevice(t, func(t *testing.T, d *gpuctx.Device) {
		if err := d.SetBlasHandleLimit(1); err != nil { // force the later callback onto the same handle
			t.Fatal(err)
		}
		defer d.SetBlasHandleLimit(gpuctx.DefaultMaxHandles)
		r := rand.New(rand.NewPCG(9, 10))
		const m, n, k, workers, each = 16, 16, 32, 4, 10
		a, b := randF32(r, m*k), randF32(r, k*n)
		aDev, bDev := upload(t, d, a), upload(t, d, b)
		want := refGemm(gpuctx.RowMajor, false, false, m, n, k, a, b)
		outs := poison(t, d, workers*each*m*n)
		sA, sB := newStream(t, d), newStream(t, d)
		ctx := newContext(t, d, gpuctx.ContextOptions{Stream: sA})
		var kept gpuctx.Blas
		err := ctx.Blas(func(h gpuctx.Blas) error {
			kept = h
			var wg sync.WaitGroup
			errs := make([]error, workers)
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range each {
						c, err := outs.Slice(4*m*n*(w*each+i), 4*m*n)
						if err == nil {
							err = h.Gemm(gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: aDev, B: bDev, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
						}
						if err != nil {
							errs[w] = err
							return
						}
					}
				}()
			}
			wg.Wait()
			return errors.Join(errs...)
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := sA.Synchronize(); err != nil {
			t.Fatal(err)
		}
		got := download(t, outs)
		for i := range workers * each {
			checkClose(t, fmt.Sprintf("GEMM %d", i), got[i*m*n:(i+1)*m*n], want, 1e-5)
		}
		// A later callback on stream B holds the same (only) handle; the kept one
		// stays expired and writes nothing.
		if _, err := ctx.SetStream(sB); err != nil {
			t.Fatal(err)
		}
		c := poison(t, d, m*n)
		err = ctx.Blas(func(h gpuctx.Blas) error {
			if err := kept.Gemm(gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: aDev, B: bDev, C: c, AB: gpuctx.F32, CType: gpuctx.F32}); !errors.Is(err, gpuctx.ErrHandleExpired) {
				return fmt.Errorf("old handle inside a new callback: want ErrHandleExpired, got %v", err)
			}
			if kept.Stream() != nil {
				return fmt.Errorf("old handle reports stream %v", kept.Stream())
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := sB.Synchronize(); err != nil {
			t.Fatal(err)
		}
		if v := download(t, c); !math.IsNaN(float64(v[0])) {
			t.Fatalf("an expired handle wrote C: %v", v[0])
		}
	})
}

// An out-of-range or malformed $GPUCTX_MAX_BLAS_HANDLES or $GPUCTX_BLAS_WORKSPACE
// is an error that names the variable and the accepted range, not a silent
// default (2^31 used to truncate to a negative limit: every callback waited).
func TestEnvLimitsAreChecked(t *testing.T) {
	for _, tc := range []struct{ name, value, rng string }{
		{gpuctx.MaxHandlesEnv, "2147483648", "[1, 1048576]"},
		{gpuctx.MaxHandlesEnv, "4294967296", "[1, 1048576]"},
		{gpuctx.MaxHandlesEnv, "0", "[1, 1048576]"},
		{gpuctx.MaxHandlesEnv, "-3", "[1, 1048576]"},
		{gpuctx.MaxHandlesEnv, "sixteen", "[1, 1048576]"},
		{gpuctx.WorkspaceEnv, "0", "[1, 4294967296]"},
		{gpuctx.WorkspaceEnv, "8589934592", "[1, 4294967296]"},
		{gpuctx.WorkspaceEnv, "32MiB", "[1, 4294967296]"},
	} {
		t.Run(tc.name+"="+tc.value, func(t *testing.T) {
			t.Setenv(tc.name, tc.value)
			d := openDevice(t, "cpu")
			c, err := d.NewContext(gpuctx.ContextOptions{})
			if err == nil {
				_ = c.Close()
				t.Fatalf("NewContext succeeded with %s=%s", tc.name, tc.value)
			}
			if !errors.Is(err, gpuctx.ErrInvalid) || !contains(err.Error(), tc.name) || !contains(err.Error(), tc.rng) {
				t.Errorf("error %q: want ErrInvalid naming %s and the range %s", err, tc.name, tc.rng)
			}
		})
	}
	t.Run("valid", func(t *testing.T) {
		t.Setenv(gpuctx.MaxHandlesEnv, "3")
		t.Setenv(gpuctx.WorkspaceEnv, "65536")
		d := openDevice(t, "cpu")
		c := newContext(t, d, gpuctx.ContextOptions{})
		if err := c.Blas(func(gpuctx.Blas) error { return nil }); err != nil {
			t.Fatal(err)
		}
		if got := d.WorkspaceBytes(); got != 65536 {
			t.Errorf("WorkspaceBytes = %d, want 65536", got)
		}
	})
}

// A callback on a closed stream is an ErrClosed error: it neither rebinds a
// handle to the stream nor allocates it a fresh workspace (which used to live
// until the device closed).
func TestCallbackOnClosedStream(t *testing.T) {
	d := openDevice(t, "cpu")
	s := newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	if err := ctx.Blas(func(gpuctx.Blas) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if n, _, _ := gpuctx.WorkspaceCounts(d); n != 1 {
		t.Fatalf("%d workspaces after one callback, want 1", n)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n, _, _ := gpuctx.WorkspaceCounts(d); n != 0 {
		t.Fatalf("%d workspaces after closing the stream, want 0", n)
	}
	ran := false
	err := ctx.Blas(func(gpuctx.Blas) error { ran = true; return nil })
	if !errors.Is(err, gpuctx.ErrClosed) || ran {
		t.Errorf("Blas on a closed stream: err %v, callback ran %v; want ErrClosed and not run", err, ran)
	}
	err = ctx.BlasLt(func(gpuctx.BlasLt) error { ran = true; return nil })
	if !errors.Is(err, gpuctx.ErrClosed) || ran {
		t.Errorf("BlasLt on a closed stream: err %v, callback ran %v; want ErrClosed and not run", err, ran)
	}
	if n, lt, _ := gpuctx.WorkspaceCounts(d); n != 0 || lt != 0 {
		t.Errorf("%d workspaces, %d Lt workspaces after callbacks on a closed stream, want 0", n, lt)
	}
}

// Sequential BlasLt callbacks on one stream reuse one cuBLASLt handle (its slot
// records the stream): they used to make a new handle each time up to the limit.
func TestBlasLtReusesHandleOnOneStream(t *testing.T) {
	d := openDevice(t, "cpu")
	ctx := newContext(t, d, gpuctx.ContextOptions{})
	for range 20 {
		if err := ctx.BlasLt(func(gpuctx.BlasLt) error { return nil }); err != nil {
			t.Fatal(err)
		}
	}
	if n := ctx.Stats().HandlesCreated; n != 1 {
		t.Errorf("20 sequential BlasLt callbacks on one stream made %d handles, want 1", n)
	}
}

// With the pool full of handles bound to closed streams, live streams take
// those first: each live stream binds once and keeps its handle, instead of
// taking one another's handles round after round.
func TestPoolPrefersHandlesOfClosedStreams(t *testing.T) {
	d := openDevice(t, "cpu")
	ctx := newContext(t, d, gpuctx.ContextOptions{})
	var filled []*gpuctx.Stream // live while the pool fills: each takes a handle of its own
	for range gpuctx.DefaultMaxHandles {
		s := newStream(t, d)
		v, err := ctx.WithStream(s)
		if err != nil {
			t.Fatal(err)
		}
		if err := v.Blas(func(gpuctx.Blas) error { return nil }); err != nil {
			t.Fatal(err)
		}
		filled = append(filled, s)
	}
	for _, s := range filled {
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if n := ctx.Stats().HandlesCreated; n != gpuctx.DefaultMaxHandles {
		t.Fatalf("made %d handles, want the pool full (%d)", n, gpuctx.DefaultMaxHandles)
	}
	before := ctx.Stats().Rebinds
	const live = 9
	views := make([]*gpuctx.Context, live)
	for i := range views {
		v, err := ctx.WithStream(newStream(t, d))
		if err != nil {
			t.Fatal(err)
		}
		views[i] = v
	}
	for range 20 {
		for _, v := range views {
			if err := v.Blas(func(gpuctx.Blas) error { return nil }); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := ctx.Stats().Rebinds - before; got != live {
		t.Errorf("%d live streams x 20 rounds made %d rebinds, want %d (one per stream)", live, got, live)
	}
}

// Streams that come and go one after another reuse the handle of the stream
// that went instead of growing the pool: a new cuBLAS handle holds device
// resources (cublasCreate allocates them) until the device closes. The
// 5-minute GPU soak saw 770 MiB of growth between its phases, which this may
// explain (not measured again on a GPU).
func TestPoolReusesHandlesOfClosedStreams(t *testing.T) {
	d := openDevice(t, "cpu")
	ctx := newContext(t, d, gpuctx.ContextOptions{})
	for range 3 * gpuctx.DefaultMaxHandles {
		s := newStream(t, d)
		v, err := ctx.WithStream(s)
		if err != nil {
			t.Fatal(err)
		}
		if err := v.Blas(func(gpuctx.Blas) error { return nil }); err != nil {
			t.Fatal(err)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if n := ctx.Stats().HandlesCreated; n != 1 {
		t.Errorf("%d streams one after another made %d handles, want 1", 3*gpuctx.DefaultMaxHandles, n)
	}
}

// cuBLASLt workspaces grown out by Reserve are freed once the stream has passed
// the work that may use them (they used to be kept until the device closed),
// and the work queued with them still computes the right result.
func TestLtRetiredWorkspacesAreFreed(t *testing.T) {
	d := openDevice(t, "cpu")
	r := rand.New(rand.NewPCG(31, 32))
	const m, n, k = 32, 32, 2048 // split-K on the CPU backend: the workspace is read
	av, bv := randF32(r, m*k), randF32(r, k*n)
	a, b := upload(t, d, av), upload(t, d, bv)
	cs := []*gpuctx.Buffer{poison(t, d, m*n), poison(t, d, m*n), poison(t, d, m*n)}
	s := newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	ws := d.WorkspaceBytes()
	err := ctx.BlasLt(func(lt gpuctx.BlasLt) error {
		for i, c := range cs {
			if i > 0 {
				if err := lt.Reserve(ws << i); err != nil {
					return err
				}
			}
			if err := lt.Matmul(gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	want := refGemm(gpuctx.RowMajor, false, false, m, n, k, av, bv)
	for i, c := range cs {
		checkClose(t, fmt.Sprintf("matmul %d", i), download(t, c), want, 1e-4)
	}
	if err := ctx.BlasLt(func(gpuctx.BlasLt) error { return nil }); err != nil { // frees what has completed
		t.Fatal(err)
	}
	if _, lt, retired := gpuctx.WorkspaceCounts(d); lt != 1 || retired != 0 {
		t.Errorf("%d Lt workspaces and %d retired ones after the stream passed its work, want 1 and 0", lt, retired)
	}
}

// Native on a handle kept past its callback checks the lease like every other
// method: it used to read the slot while Context.Close destroyed it (a data
// race under -race).
func TestNativeChecksLease(t *testing.T) {
	d := openDevice(t, "cpu")
	for range 50 {
		ctx, err := d.NewContext(gpuctx.ContextOptions{Policy: gpuctx.SharedHandle})
		if err != nil {
			t.Fatal(err)
		}
		var kept gpuctx.Blas
		if err := ctx.Blas(func(h gpuctx.Blas) error { kept = h; _ = h.Native(); return nil }); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		wg.Go(func() { _ = ctx.Close() })
		if kept.Native() {
			t.Error("an expired handle reports a native grouped GEMM")
		}
		wg.Wait()
	}
}

// checkBinding checks, inside a callback, what the library handle itself holds
// (CPU backend; nothing to check on CUDA): bound to want, with want's own
// workspace applied (cuBLAS's set-stream resets the workspace, and the CPU
// handle models that, so a skipped re-apply shows here). h.Stream() is only the
// Context's record and must agree.
func checkBinding(h gpuctx.Blas, want *gpuctx.Stream) error {
	if h.Stream() != want {
		return fmt.Errorf("handle lent for stream %v, want %d", h.Stream(), want.ID())
	}
	id, ws, n, ok := gpuctx.HandleBinding(h)
	if !ok {
		return nil
	}
	if id != want.ID() {
		return fmt.Errorf("library handle bound to stream %d, want %d", id, want.ID())
	}
	wp, wn := gpuctx.StreamWorkspace(want)
	if ws != wp || n != wn || ws == 0 {
		return fmt.Errorf("library handle holds workspace [%#x, +%d), want stream %d's [%#x, +%d)", ws, n, want.ID(), wp, wn)
	}
	return nil
}

// SetStream racing callbacks: every callback's handle is bound (as the library
// holds it) to the stream its h.Stream() reports, with that stream's workspace.
// A Context that read its current stream twice (once to bind, once to lend)
// may be caught here, depending on timing; TestContract's StreamReadOnce
// catches it every run (a hook switches the stream after every read).
func TestSetStreamRacesCallbacks(t *testing.T) {
	for _, pol := range []gpuctx.HandlePolicy{gpuctx.SharedHandle, gpuctx.PooledHandles} {
		t.Run(pol.String(), func(t *testing.T) {
			d := openDevice(t, "cpu")
			ss := []*gpuctx.Stream{newStream(t, d), newStream(t, d), newStream(t, d)}
			ctx := newContext(t, d, gpuctx.ContextOptions{Stream: ss[0], Policy: pol})
			stop := make(chan struct{})
			within(t, 60*time.Second, "SetStream against callbacks", func() {
				var flips sync.WaitGroup
				flips.Go(func() {
					for i := 0; ; i++ {
						select {
						case <-stop:
							return
						default:
						}
						if _, err := ctx.SetStream(ss[i%len(ss)]); err != nil {
							t.Error(err)
							return
						}
					}
				})
				var wg sync.WaitGroup
				for range 4 {
					wg.Go(func() {
						for range 500 {
							err := ctx.Blas(func(h gpuctx.Blas) error {
								s := h.Stream()
								if s == nil {
									return errors.New("nil stream inside the callback")
								}
								runtime.Gosched()
								return checkBinding(h, s)
							})
							if err != nil {
								t.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
				close(stop)
				flips.Wait()
			})
		})
	}
}

// Every rebind re-applies the stream's workspace: one handle (shared policy, or
// a pool of one) moved among three streams always holds the current stream's
// workspace, never the library default that set-stream leaves.
func TestWorkspaceReappliedAfterEveryRebind(t *testing.T) {
	d := openDevice(t, "cpu")
	if err := d.SetBlasHandleLimit(1); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.SetBlasHandleLimit(gpuctx.DefaultMaxHandles) })
	ss := []*gpuctx.Stream{newStream(t, d), newStream(t, d), newStream(t, d)}
	for _, pol := range []gpuctx.HandlePolicy{gpuctx.SharedHandle, gpuctx.PooledHandles} {
		ctx := newContext(t, d, gpuctx.ContextOptions{Stream: ss[0], Policy: pol})
		for i := range 30 {
			s := ss[(i*7/3)%len(ss)]
			if _, err := ctx.SetStream(s); err != nil {
				t.Fatal(err)
			}
			if err := ctx.Blas(func(h gpuctx.Blas) error { return checkBinding(h, s) }); err != nil {
				t.Fatalf("%v, call %d: %v", pol, i, err)
			}
		}
		if st := ctx.Stats(); st.Rebinds == 0 || st.WorkspaceApplies != st.Binds {
			t.Errorf("%v: want rebinds, each followed by a workspace application; got %+v", pol, st)
		}
	}
}

// roundTF32 rounds to TF32 (10 mantissa bits), ties to even, as tensor cores do.
func roundTF32(f float32) float32 {
	b := math.Float32bits(f)
	b += 0xfff + (b>>13)&1
	return math.Float32frombits(b &^ 0x1fff)
}

// The TF32 flavour computes with TF32-rounded inputs only when the Context
// allows it; otherwise it is full f32. Checked against references on CPU.
func TestTF32FlavourResults(t *testing.T) {
	d := openDevice(t, "cpu")
	r := rand.New(rand.NewPCG(41, 42))
	const m, n, k = 16, 24, 64
	av, bv := randF32(r, m*k), randF32(r, k*n)
	a, b := upload(t, d, av), upload(t, d, bv)
	at, bt := make([]float32, len(av)), make([]float32, len(bv))
	for i, v := range av {
		at[i] = roundTF32(v)
	}
	for i, v := range bv {
		bt[i] = roundTF32(v)
	}
	full := refGemm(gpuctx.RowMajor, false, false, m, n, k, av, bv)
	tf32 := refGemm(gpuctx.RowMajor, false, false, m, n, k, at, bt)
	for _, allow := range []bool{false, true} {
		ctx := newContext(t, d, gpuctx.ContextOptions{AllowTF32: allow})
		c := poison(t, d, m*n)
		err := ctx.BlasFlavour(gpuctx.TF32, func(h gpuctx.Blas) error {
			return h.Gemm(gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := ctx.Stream().Synchronize(); err != nil {
			t.Fatal(err)
		}
		got := download(t, c)
		want, other := full, tf32
		if allow {
			want, other = tf32, full
		}
		eWant, eOther := blastest.RelErr(to64(got), want), blastest.RelErr(to64(got), other)
		if !(eWant <= 1e-6) || !(eOther > 10*eWant) {
			t.Errorf("AllowTF32=%v: relative error %.2g against the expected math, %.2g against the other; want the expected one exact and the other clearly off", allow, eWant, eOther)
		}
	}
}

// cuBLASLt matmuls on the CPU backend: f32 and bf16 inputs, f32 output, right
// results, queued on the callback's stream; closing the stream frees its
// workspaces (eager and cuBLASLt).
func TestBlasLtResultsAndStreamCloseFreesWorkspaces(t *testing.T) {
	d := openDevice(t, "cpu")
	r := rand.New(rand.NewPCG(43, 44))
	const m, n, k = 16, 8, 32
	av, bv := randF32(r, m*k), randF32(r, k*n)
	s := newStream(t, d)
	ctx := newContext(t, d, gpuctx.ContextOptions{Stream: s})
	a, b, c := upload(t, d, av), upload(t, d, bv), poison(t, d, m*n)
	ab16, bb16 := toBF16(av), toBF16(bv)
	a16, b16, c2 := uploadU16(t, d, ab16), uploadU16(t, d, bb16), poison(t, d, m*n)
	err := ctx.BlasLt(func(lt gpuctx.BlasLt) error {
		if lt.Stream() != s {
			return fmt.Errorf("Lt handle for stream %v, want %d", lt.Stream(), s.ID())
		}
		if err := lt.Matmul(gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: a, B: b, C: c, AB: gpuctx.F32, CType: gpuctx.F32}); err != nil {
			return err
		}
		return lt.Matmul(gpuctx.Gemm{M: m, N: n, K: k, Alpha: 1, A: a16, B: b16, C: c2, AB: gpuctx.BF16, CType: gpuctx.F32})
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := ctx.Blas(func(gpuctx.Blas) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	checkClose(t, "lt f32", download(t, c), refGemm(gpuctx.RowMajor, false, false, m, n, k, av, bv), 1e-5)
	checkClose(t, "lt bf16", download(t, c2), refGemm(gpuctx.RowMajor, false, false, m, n, k, fromBF16(ab16), fromBF16(bb16)), 1e-5)
	if ws, lt, _ := gpuctx.WorkspaceCounts(d); ws != 1 || lt != 1 {
		t.Fatalf("%d workspaces and %d Lt workspaces before closing the stream, want 1 and 1", ws, lt)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if ws, lt, retired := gpuctx.WorkspaceCounts(d); ws != 0 || lt != 0 || retired != 0 {
		t.Errorf("after closing the stream: %d workspaces, %d Lt, %d retired; want none", ws, lt, retired)
	}
}

func toBF16(x []float32) []uint16 {
	out := make([]uint16, len(x))
	for i, v := range x {
		out[i] = half.BF16(v)
	}
	return out
}

func fromBF16(x []uint16) []float32 {
	out := make([]float32, len(x))
	for i, v := range x {
		out[i] = half.FromBF16(v)
	}
	return out
}

func uploadU16(t *testing.T, d *gpuctx.Device, x []uint16) *gpuctx.Buffer {
	t.Helper()
	b, err := d.Alloc(2 * len(x))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.CopyFromHost(unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 2*len(x))); err != nil {
		t.Fatal(err)
	}
	return b
}
