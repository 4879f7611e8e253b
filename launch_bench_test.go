package gpuctx

import (
	"runtime"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx/backend/cuda"
	"github.com/gpuctx/gpuctx/internal/hal"
)

// BenchmarkOverheadVsBare times, alternately in one loop, a kernel launch and an
// event record through gpuctx (Stream.Launch, Event.Record: validation, the
// context check on the calling thread, the backend) and the bare purego call of
// cuLaunchKernel / cuEventRecord. overhead-% is (gpuctx - bare) / bare. CUDA only.
func BenchmarkOverheadVsBare(b *testing.B) {
	rt, err := OpenBackend("cuda")
	if err != nil {
		b.Skipf("CUDA not available: %v", err)
	}
	defer rt.Close()
	d, err := rt.Device(0)
	if err != nil {
		b.Fatal(err)
	}
	s, err := d.NewStream(StreamOptions{})
	if err != nil {
		b.Fatal(err)
	}
	k, err := d.Kernel("gpuctx_empty")
	if err != nil {
		b.Fatal(err)
	}
	e, err := d.NewEvent(false)
	if err != nil {
		b.Fatal(err)
	}
	bareLaunch, err := cuda.BareLaunch(d.hd, s.hs, k.k)
	if err != nil {
		b.Fatal(err)
	}
	bareRecord, err := cuda.BareEventRecord(d.hd, e.he, s.hs)
	if err != nil {
		b.Fatal(err)
	}
	one := Dim3{X: 1, Y: 1, Z: 1}
	cases := []struct {
		name       string
		ours, bare func() error
	}{
		{"launch", func() error { return s.Launch(k, one, one, 0) }, bareLaunch},
		{"record", func() error { return e.Record(s) }, bareRecord},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			runtime.LockOSThread() // the bare call needs the context current on this thread
			defer runtime.UnlockOSThread()
			if err := d.hd.(hal.Runner).Do(func() error { return nil }); err != nil {
				b.Fatal(err)
			}
			var ours, bare time.Duration
			n := 0
			for b.Loop() {
				t0 := time.Now()
				if err := c.ours(); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if err := c.bare(); err != nil {
					b.Fatal(err)
				}
				bare += time.Since(t1)
				ours += t1.Sub(t0)
				if n++; n%512 == 0 {
					if err := s.Synchronize(); err != nil {
						b.Fatal(err)
					}
				}
			}
			if err := s.Synchronize(); err != nil {
				b.Fatal(err)
			}
			o, r := float64(ours.Nanoseconds())/float64(n), float64(bare.Nanoseconds())/float64(n)
			b.ReportMetric(o, "gpuctx-ns/call")
			b.ReportMetric(r, "bare-ns/call")
			b.ReportMetric(100*(o-r)/r, "overhead-%")
		})
	}
}
