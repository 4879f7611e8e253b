package cuda

import (
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// benchPair times halCall and bareCall alternately, one call each per
// iteration, and reports both means and their ratio. sync drains the queue
// every 512 iterations, outside the timed calls, so the launch queue never
// fills and blocks. The goroutine stays on one thread with the context
// current for the bare calls; the hal path still runs its full Do wrapper.
func benchPair(b *testing.B, d *device, halCall, bareCall, sync func() error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := d.Do(func() error { return nil }); err != nil { // make the context current on this thread
		b.Fatal(err)
	}
	var tHal, tBare time.Duration
	var n int
	for b.Loop() {
		t0 := time.Now()
		if err := halCall(); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := bareCall(); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		tHal += t1.Sub(t0)
		tBare += t2.Sub(t1)
		n++
		if n%512 == 0 {
			if err := sync(); err != nil {
				b.Fatal(err)
			}
		}
	}
	if err := sync(); err != nil {
		b.Fatal(err)
	}
	hal, bare := float64(tHal.Nanoseconds())/float64(n), float64(tBare.Nanoseconds())/float64(n)
	b.ReportMetric(hal, "hal-ns/call")
	b.ReportMetric(bare, "bare-ns/call")
	b.ReportMetric(hal-bare, "overhead-ns/call")
	b.ReportMetric(hal/bare, "hal/bare")
}

// BenchmarkLaunchEmpty compares Stream.Launch of gpuctx_empty with a bare
// purego call of cuLaunchKernel.
func BenchmarkLaunchEmpty(b *testing.B) {
	d := gpu(b)
	s := newStream(b, d, hal.StreamOptions{NonBlocking: true})
	k := mustKernel(b, d, "gpuctx_empty").(*kernel)
	one := hal.Dim3{X: 1, Y: 1, Z: 1}
	st := s.(*stream)
	benchPair(b, d,
		func() error { return s.Launch(k, one, one, 0) },
		func() error {
			return check(d.api, "cuLaunchKernel", d.api.cuLaunchKernel(k.fn, 1, 1, 1, 1, 1, 1, 0, st.h, nil, nil))
		},
		s.Synchronize)
}

// BenchmarkLaunchArgs is BenchmarkLaunchEmpty for a kernel with three
// arguments (parameter block packing included).
func BenchmarkLaunchArgs(b *testing.B) {
	d := gpu(b)
	s := newStream(b, d, hal.StreamOptions{NonBlocking: true})
	k := mustKernel(b, d, "gpuctx_fill_f32").(*kernel)
	y := devAlloc(b, d, 1024)
	one := hal.Dim3{X: 1, Y: 1, Z: 1}
	st := s.(*stream)
	pb := new(paramBlock)
	benchPair(b, d,
		func() error { return s.Launch(k, one, one, 0, y, float32(1), int64(0)) },
		func() error {
			if _, err := pack(k.name, pb, []any{y, float32(1), int64(0)}); err != nil {
				return err
			}
			r := d.api.cuLaunchKernel(k.fn, 1, 1, 1, 1, 1, 1, 0, st.h, unsafe.Pointer(&pb.ptrs[0]), nil)
			runtime.KeepAlive(pb)
			return check(d.api, "cuLaunchKernel", r)
		},
		s.Synchronize)
}

// BenchmarkEventRecord compares Event.Record with a bare cuEventRecord.
func BenchmarkEventRecord(b *testing.B) {
	d := gpu(b)
	s := newStream(b, d, hal.StreamOptions{NonBlocking: true})
	e, err := d.NewEvent(false)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Destroy()
	ev, st := e.(*event), s.(*stream)
	benchPair(b, d,
		func() error { return e.Record(s) },
		func() error { return check(d.api, "cuEventRecord", d.api.cuEventRecord(ev.h, st.h)) },
		s.Synchronize)
}

// BenchmarkContextCheck measures the Do wrapper alone (LockOSThread,
// cuCtxGetCurrent, UnlockOSThread), from a goroutine that is not pinned.
func BenchmarkContextCheck(b *testing.B) {
	d := gpu(b)
	nop := func() error { return nil }
	for b.Loop() {
		if err := d.Do(nop); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkContextCheckParallel is BenchmarkContextCheck from GOMAXPROCS
// goroutines at once.
func BenchmarkContextCheckParallel(b *testing.B) {
	d := gpu(b)
	nop := func() error { return nil }
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := d.Do(nop); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
