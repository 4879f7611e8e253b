package cuda

import (
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// timedCall is one way of making the same driver call.
type timedCall struct {
	name string // metric prefix: "hal", "bare" (purego.RegisterFunc), "syscalln"
	fn   func() error
}

// benchCalls times each call once per iteration, in turn, and reports the mean
// of each and the ratio hal/bare. sync drains the queue every 512 iterations,
// outside the timed calls, so the launch queue never fills and blocks. The
// goroutine stays on one thread with the context current for the bare calls;
// the hal path still runs its full Do wrapper.
func benchCalls(b *testing.B, d *device, sync func() error, calls ...timedCall) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := d.Do(func() error { return nil }); err != nil { // make the context current on this thread
		b.Fatal(err)
	}
	total := make([]time.Duration, len(calls))
	var n int
	for b.Loop() {
		for i, c := range calls {
			t0 := time.Now()
			if err := c.fn(); err != nil {
				b.Fatalf("%s: %v", c.name, err)
			}
			total[i] += time.Since(t0)
		}
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
	mean := map[string]float64{}
	for i, c := range calls {
		mean[c.name] = float64(total[i].Nanoseconds()) / float64(n)
		b.ReportMetric(mean[c.name], c.name+"-ns/call")
	}
	b.ReportMetric(mean["hal"]-mean["bare"], "overhead-ns/call")
	b.ReportMetric(mean["hal"]/mean["bare"], "hal/bare")
}

// BenchmarkLaunchEmpty compares Stream.Launch of gpuctx_empty with a bare
// purego call of cuLaunchKernel.
func BenchmarkLaunchEmpty(b *testing.B) {
	d := gpu(b)
	s := newStream(b, d, hal.StreamOptions{NonBlocking: true})
	k := mustKernel(b, d, "gpuctx_empty").(*kernel)
	one := hal.Dim3{X: 1, Y: 1, Z: 1}
	st := s.(*stream)
	g := [3]uint32{1, 1, 1}
	benchCalls(b, d, s.Synchronize,
		timedCall{"hal", func() error { return s.Launch(k, one, one, 0) }},
		timedCall{"bare", func() error {
			return check(d.api, "cuLaunchKernel", d.api.cuLaunchKernel(k.fn, 1, 1, 1, 1, 1, 1, 0, st.h, nil, nil))
		}},
		timedCall{"syscalln", func() error {
			return check(d.api, "cuLaunchKernel", d.api.launchKernel(k.fn, g, g, 0, st.h, nil))
		}})
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
	benchCalls(b, d, s.Synchronize,
		timedCall{"hal", func() error { return s.Launch(k, one, one, 0, y, float32(1), int64(0)) }},
		timedCall{"bare", func() error {
			if _, err := pack(k.name, pb, []any{y, float32(1), int64(0)}); err != nil {
				return err
			}
			r := d.api.cuLaunchKernel(k.fn, 1, 1, 1, 1, 1, 1, 0, st.h, unsafe.Pointer(&pb.ptrs[0]), nil)
			runtime.KeepAlive(pb)
			return check(d.api, "cuLaunchKernel", r)
		}})
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
	benchCalls(b, d, s.Synchronize,
		timedCall{"hal", func() error { return e.Record(s) }},
		timedCall{"bare", func() error { return check(d.api, "cuEventRecord", d.api.cuEventRecord(ev.h, st.h)) }},
		timedCall{"syscalln", func() error { return check(d.api, "cuEventRecord", d.api.eventRecord(ev.h, st.h)) }})
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

// BenchmarkContextCheckBare is the cuCtxGetCurrent call of Do alone (through
// SyscallN), on a pinned goroutine, for comparison with BenchmarkContextCheck.
func BenchmarkContextCheckBare(b *testing.B) {
	d := gpu(b)
	var cur uintptr
	for b.Loop() {
		if r := d.api.ctxGetCurrent(&cur); r != cudaSuccess {
			b.Fatal(check(d.api, "cuCtxGetCurrent", r))
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
