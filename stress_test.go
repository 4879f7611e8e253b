package gpuctx_test

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"

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
