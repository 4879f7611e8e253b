package gpuctx_test

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx"
)

// stressWorkers is the number of goroutines of the migration stress test.
const stressWorkers = 64

// stressIters returns how many iterations each worker runs. CUDA gets the full
// 1000 (200 under -short): the test exists for it, because CUDA's current
// context is per OS thread and goroutines migrate between threads at any call.
// The CPU backend has no per-thread state to get wrong and runs every stream
// as goroutines, so 64x1000 iterations would only make CI slow under the race
// detector on two cores; 200 per worker (about 10 s with -race) still runs
// 12,800 concurrent cross-stream event waits, which is what the race detector
// needs to see.
func stressIters(backend string) int {
	switch {
	case backend == "cpu":
		return 200
	case testing.Short():
		return 200
	}
	return 1000
}

// TestStressMigration runs 64 goroutines with GOMAXPROCS >= 8 (so goroutines
// move between OS threads), each repeating: alloc, async host-to-device copy,
// two gpuctx_add_i32 launches on stream A, event record on A, wait on stream B,
// async device-to-host copy on B, synchronise B, check every element, free. No
// goroutine locks its OS thread: the library must make that safe.
func TestStressMigration(t *testing.T) {
	for _, backend := range []string{"cpu", "cuda"} {
		t.Run(backend, func(t *testing.T) {
			dev := openDevice(t, backend)
			prev := runtime.GOMAXPROCS(max(8, runtime.NumCPU()))
			t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
			iters := stressIters(backend)
			t.Logf("%d goroutines x %d iterations on %s, GOMAXPROCS %d", stressWorkers, iters, backend, runtime.GOMAXPROCS(0))
			add, err := dev.Kernel("gpuctx_add_i32")
			if err != nil {
				t.Fatalf("Device.Kernel: %v", err)
			}
			errs := make(chan error, stressWorkers)
			var wg sync.WaitGroup
			for w := range stressWorkers {
				wg.Go(func() {
					if err := stressWorker(dev, add, t.Name(), w, iters); err != nil {
						errs <- fmt.Errorf("worker %d: %w", w, err)
					}
				})
			}
			wg.Wait()
			close(errs)
			n := 0
			for err := range errs {
				if n++; n <= 5 {
					t.Error(err)
				}
			}
			if n > 5 {
				t.Errorf("... and %d more workers failed", n-5)
			}
			if err := dev.Synchronize(); err != nil {
				t.Errorf("Device.Synchronize after the stress run: %v", err)
			}
		})
	}
}

// stressWorker runs one worker's iterations; it returns the first failure.
func stressWorker(dev *gpuctx.Device, add *gpuctx.Kernel, name string, w, iters int) (err error) {
	const maxElems = 4096
	h := fnv.New64a()
	fmt.Fprintf(h, "%s/%d", name, w)
	r := rand.New(rand.NewPCG(h.Sum64(), uint64(w)))

	var closers []func() error
	defer func() {
		for i := len(closers) - 1; i >= 0; i-- {
			if cerr := closers[i](); cerr != nil && err == nil {
				err = cerr
			}
		}
	}()
	a, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return err
	}
	closers = append(closers, a.Close)
	b, err := dev.NewStream(gpuctx.StreamOptions{})
	if err != nil {
		return err
	}
	closers = append(closers, b.Close)
	ev, err := dev.NewEvent(false)
	if err != nil {
		return err
	}
	closers = append(closers, ev.Close)
	in, err := dev.AllocHost(4 * maxElems)
	if err != nil {
		return err
	}
	closers = append(closers, in.Free)
	out, err := dev.AllocHost(4 * maxElems)
	if err != nil {
		return err
	}
	closers = append(closers, out.Free)

	want := make([]int32, maxElems)
	for it := range iters {
		n := 1 + r.IntN(maxElems)
		v := int32(r.IntN(2001) - 1000)
		inb, outb := in.Bytes(), out.Bytes()
		for i := range n {
			x := int32(r.Uint32() >> 2)
			binary.LittleEndian.PutUint32(inb[4*i:], uint32(x))
			want[i] = x + 2*v
			binary.LittleEndian.PutUint32(outb[4*i:], 0xdeadbeef)
		}
		y, err := dev.Alloc(4 * n)
		if err != nil {
			return fmt.Errorf("iteration %d: %w", it, err)
		}
		grid, block := gpuctx.Dim3{X: 1 + r.IntN(8), Y: 1, Z: 1}, gpuctx.Dim3{X: 32 * (1 + r.IntN(8)), Y: 1, Z: 1}
		steps := []struct {
			what string
			do   func() error
		}{
			{"CopyHtoD", func() error { return a.CopyHtoD(y, 0, in, 0, 4*n) }},
			{"Launch 1", func() error { return a.Launch(add, grid, block, 0, y, v, int64(n)) }},
			{"Launch 2", func() error { return a.Launch(add, grid, block, 0, y, v, int64(n)) }},
			{"Event.Record", func() error { return ev.Record(a) }},
			{"B.Wait", func() error { return b.Wait(ev) }},
			{"CopyDtoH", func() error { return b.CopyDtoH(out, 0, y, 0, 4*n) }},
			{"B.Synchronize", b.Synchronize},
		}
		for _, s := range steps {
			if err := s.do(); err != nil {
				_ = a.Synchronize()
				_ = y.Free()
				return fmt.Errorf("iteration %d (n=%d): %s: %w", it, n, s.what, err)
			}
		}
		for i := range n {
			if got := int32(binary.LittleEndian.Uint32(outb[4*i:])); got != want[i] {
				_ = y.Free()
				return fmt.Errorf("iteration %d (n=%d, v=%d): element %d = %d, want %d", it, n, v, i, got, want[i])
			}
		}
		// B waited for everything A had queued, so y is no longer in use.
		if err := y.Free(); err != nil {
			return fmt.Errorf("iteration %d: Free: %w", it, err)
		}
	}
	return nil
}

// within runs fn and fails the test if it has not returned after d, printing
// every goroutine's stack, instead of letting a hang eat the package timeout.
func within(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Fatalf("%s: still running after %v (hang); goroutines:\n%s", what, d, buf)
	}
}

// TestPoolNoLostWakeup: with a pool limit of 1 or 2, rounds of goroutines that
// each make one callback, a round at a time. A release that slips between a
// waiter's failed look for a free handle and its going to sleep must still wake
// it: a lost wakeup leaves the last waiter of a round asleep with nobody left to
// release, and the round's deadline fails the test instead of hanging.
func TestPoolNoLostWakeup(t *testing.T) {
	dev := openDevice(t, "cpu")
	prev := runtime.GOMAXPROCS(max(4, runtime.NumCPU()))
	t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
	streams := []*gpuctx.Stream{newStream(t, dev), newStream(t, dev), newStream(t, dev)}
	ctx := newContext(t, dev, gpuctx.ContextOptions{Stream: streams[0]})
	rounds := 20000
	if testing.Short() {
		rounds = 4000
	}
	for _, limit := range []int{1, 2} {
		t.Run(fmt.Sprintf("limit%d", limit), func(t *testing.T) {
			if err := dev.SetBlasHandleLimit(limit); err != nil {
				t.Fatal(err)
			}
			views := make([]*gpuctx.Context, 4)
			for i := range views {
				v, err := ctx.WithStream(streams[i%len(streams)])
				if err != nil {
					t.Fatal(err)
				}
				views[i] = v
			}
			var calls atomic.Int64
			within(t, 60*time.Second, "all rounds", func() {
				for r := range rounds {
					var wg sync.WaitGroup
					for g := range limit + 2 {
						v := views[(r+g)%len(views)]
						wg.Go(func() {
							err := v.Blas(func(gpuctx.Blas) error {
								if g%2 == 0 {
									runtime.Gosched()
								}
								calls.Add(1)
								return nil
							})
							if err != nil {
								t.Errorf("round %d: %v", r, err)
							}
						})
					}
					wg.Wait()
				}
			})
			if want := int64(rounds * (limit + 2)); calls.Load() != want {
				t.Errorf("%d callbacks ran, want %d", calls.Load(), want)
			}
			t.Logf("%d rounds, stats %+v", rounds, ctx.Stats())
		})
	}
	_ = dev.SetBlasHandleLimit(gpuctx.DefaultMaxHandles)
}

// TestPoolManyGoroutines: 64 goroutines on 8 streams, pool limits 1 and 2, a
// few hundred callbacks each with a GEMM; every callback completes before the
// deadline and no handle is ever used by two callbacks at once (the race
// detector and the handle count check it).
func TestPoolManyGoroutines(t *testing.T) {
	dev := openDevice(t, "cpu")
	streams := make([]*gpuctx.Stream, 8)
	for i := range streams {
		streams[i] = newStream(t, dev)
	}
	ctx := newContext(t, dev, gpuctx.ContextOptions{Stream: streams[0]})
	a, err := dev.Alloc(4 * 16)
	if err != nil {
		t.Fatal(err)
	}
	cs := make([]*gpuctx.Buffer, 64) // freed with the device, after its work
	for i := range cs {
		if cs[i], err = dev.Alloc(4 * 16); err != nil {
			t.Fatal(err)
		}
	}
	for _, limit := range []int{1, 2} {
		t.Run(fmt.Sprintf("limit%d", limit), func(t *testing.T) {
			if err := dev.SetBlasHandleLimit(limit); err != nil {
				t.Fatal(err)
			}
			var inside atomic.Int32
			within(t, 120*time.Second, "64 goroutines", func() {
				var wg sync.WaitGroup
				for g := range 64 {
					v, err := ctx.WithStream(streams[g%len(streams)])
					if err != nil {
						t.Error(err)
						return
					}
					c := cs[g]
					wg.Go(func() {
						for range 100 {
							err := v.Blas(func(h gpuctx.Blas) error {
								if n := inside.Add(1); int(n) > limit {
									t.Errorf("%d callbacks inside at once with a limit of %d", n, limit)
								}
								defer inside.Add(-1)
								return h.Gemm(gpuctx.Gemm{M: 4, N: 4, K: 4, Alpha: 1, A: a, B: a, C: c, AB: gpuctx.F32, CType: gpuctx.F32})
							})
							if err != nil {
								t.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
			})
		})
	}
	_ = dev.SetBlasHandleLimit(gpuctx.DefaultMaxHandles)
}
